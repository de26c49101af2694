/* An AVX2-only x86 processor, as the process sees it: AVX-512 and AMX hidden from every CPUID query.

   Loaded with LD_PRELOAD by benchmarks/machine.py (`--isa avx2`). Kernel libraries pick their code at run
   time from CPUID (YNNPACK's and oneDNN's dot kernels, LLVM's host features in XLA:CPU, torch's ATen and
   MKL): XLA's --xla_cpu_max_isa restricts only the code XLA's LLVM backend emits, not YNNPACK's matrix
   products, which are most of a decoding step. Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, the
   `cpuid_fault` flag) makes every CPUID instruction of this process trap; the SIGSEGV handler answers it
   from the real answers read once at start, with the AVX-512 and AMX bits cleared, so every library in
   the process sees what an AVX2 machine (an AMD EPYC of Zen 2 or 3) would show.

   PAX_CPUID_MASK_ONLY=SUBSTRING: mask only the queries made from code in a shared object whose path holds
   SUBSTRING (e.g. `jaxlib`: XLA restricted, torch not). pax_cpuid_answered() counts masked answers. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#ifndef ARCH_SET_CPUID
#define ARCH_SET_CPUID 0x1012
#endif

#define SUBLEAVES 64
#define BASIC 64
#define EXTENDED 64
#define HYPERVISOR 16

typedef struct { uint32_t r[4]; } regs;   /* eax, ebx, ecx, edx */

static regs basic[BASIC][SUBLEAVES], extended[EXTENDED][SUBLEAVES], hypervisor[HYPERVISOR][SUBLEAVES];
static uint32_t max_basic, max_extended;
static const char *only;
static volatile long answered;
static int active;
static struct sigaction next_segv;   /* whoever else handles SIGSEGV: called for every other fault */

static void clear(uint32_t *reg, const int *bits) {
  for (; *bits >= 0; bits++) *reg &= ~(1u << *bits);
}

/* The AVX-512 families and AMX, by leaf: what AVX2-only processors lack. */
static void mask(uint32_t leaf, uint32_t sub, regs *out) {
  static const int l7_ebx[] = {16, 17, 21, 26, 27, 28, 30, 31, -1};  /* F DQ IFMA PF ER CD BW VL */
  static const int l7_ecx[] = {1, 6, 11, 12, 14, -1};                /* VBMI VBMI2 VNNI BITALG VPOPCNTDQ */
  static const int l7_edx[] = {2, 3, 8, 22, 23, 24, 25, -1};         /* 4VNNIW 4FMAPS VP2INTERSECT AMX-BF16 FP16 AMX-TILE AMX-INT8 */
  static const int l71_eax[] = {4, 5, 21, -1};                       /* AVX-VNNI, AVX512-BF16, AMX-FP16 */
  static const int xsave[] = {5, 6, 7, 17, 18, -1};                   /* opmask, ZMM state, AMX tile state */
  if (leaf == 7 && sub == 0) {
    clear(&out->r[1], l7_ebx);
    clear(&out->r[2], l7_ecx);
    clear(&out->r[3], l7_edx);
  } else if (leaf == 7 && sub == 1) {
    clear(&out->r[0], l71_eax);
  } else if (leaf == 0xd && sub == 0) {
    clear(&out->r[0], xsave);
  } else if (leaf == 0x1d || leaf == 0x1e) {   /* AMX tile and TMUL information */
    memset(out, 0, sizeof *out);
  }
}

static regs lookup(uint32_t leaf, uint32_t sub) {
  regs zero = {{0, 0, 0, 0}};
  uint32_t s = sub < SUBLEAVES ? sub : SUBLEAVES - 1;
  if (leaf < BASIC) return leaf <= max_basic ? basic[leaf][s] : basic[max_basic < BASIC ? max_basic : 0][s];
  if (leaf >= 0x80000000u && leaf - 0x80000000u < EXTENDED)
    return leaf <= max_extended ? extended[leaf - 0x80000000u][s] : zero;
  if (leaf >= 0x40000000u && leaf - 0x40000000u < HYPERVISOR) return hypervisor[leaf - 0x40000000u][s];
  return zero;
}

static int masked_here(void *ip) {
  Dl_info info;
  if (!only) return 1;
  return dladdr(ip, &info) && info.dli_fname && strstr(info.dli_fname, only);
}

static void on_segv(int sig, siginfo_t *si, void *ctx) {
  ucontext_t *uc = ctx;
  unsigned char *ip = (unsigned char *)uc->uc_mcontext.gregs[REG_RIP];
  if (ip && ip[0] == 0x0f && ip[1] == 0xa2) {   /* CPUID */
    uint32_t leaf = (uint32_t)uc->uc_mcontext.gregs[REG_RAX], sub = (uint32_t)uc->uc_mcontext.gregs[REG_RCX];
    regs out = lookup(leaf, sub);
    if (masked_here(ip)) {
      mask(leaf, sub, &out);
      answered++;
    }
    uc->uc_mcontext.gregs[REG_RAX] = out.r[0];
    uc->uc_mcontext.gregs[REG_RBX] = out.r[1];
    uc->uc_mcontext.gregs[REG_RCX] = out.r[2];
    uc->uc_mcontext.gregs[REG_RDX] = out.r[3];
    uc->uc_mcontext.gregs[REG_RIP] += 2;
    return;
  }
  if (next_segv.sa_flags & SA_SIGINFO && next_segv.sa_sigaction) {
    next_segv.sa_sigaction(sig, si, ctx);
  } else if (next_segv.sa_handler != SIG_DFL && next_segv.sa_handler != SIG_IGN && next_segv.sa_handler) {
    next_segv.sa_handler(sig);
  } else {   /* the default action: the faulting instruction runs again and kills the process */
    signal(SIGSEGV, SIG_DFL);
  }
}

/* Others may install a SIGSEGV handler later (faulthandler): it is kept as the next handler, ours stays. */
int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  static int (*real)(int, const struct sigaction *, struct sigaction *);
  if (!real) real = dlsym(RTLD_NEXT, "sigaction");
  if (sig != SIGSEGV || !active) return real(sig, act, old);
  if (old) *old = next_segv;
  if (act) next_segv = *act;
  return 0;
}

long pax_cpuid_answered(void) { return answered; }

static void record(regs table[][SUBLEAVES], uint32_t first, uint32_t count) {
  for (uint32_t i = 0; i < count; i++)
    for (uint32_t s = 0; s < SUBLEAVES; s++) {
      regs *r = &table[i][s];
      __cpuid_count(first + i, s, r->r[0], r->r[1], r->r[2], r->r[3]);
    }
}

__attribute__((constructor)) static void start(void) {
  uint32_t a, b, c, d;
  __cpuid(0, a, b, c, d);
  max_basic = a;
  __cpuid(0x80000000u, a, b, c, d);
  max_extended = a;
  record(basic, 0, max_basic + 1 < BASIC ? max_basic + 1 : BASIC);
  record(extended, 0x80000000u, max_extended - 0x80000000u + 1 < EXTENDED ? max_extended - 0x80000000u + 1 : EXTENDED);
  record(hypervisor, 0x40000000u, HYPERVISOR);
  only = getenv("PAX_CPUID_MASK_ONLY");
  if (only && !*only) only = NULL;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  int (*real)(int, const struct sigaction *, struct sigaction *) = dlsym(RTLD_NEXT, "sigaction");
  if (real(SIGSEGV, &sa, &next_segv) != 0) return;
  if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {   /* no CPUID faulting here: nothing masked */
    real(SIGSEGV, &next_segv, NULL);
    return;
  }
  active = 1;
}
