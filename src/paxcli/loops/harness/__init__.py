"""lm-evaluation-harness on a paxcli checkpoint: `pax lm-eval`; each module imports only those above it.

  model     PaxLM, the harness's `lm_eval.api.model.LM` (registered as `paxcli`): loglikelihood and
            loglikelihood_rolling through `pax score`'s requests and Scorer, generate_until through
            the Decoder, batched on the mesh
  command   lm_eval(): tasks resolved, the harness's own simple_evaluate run, results written and printed

Both import lm_eval (the `eval` extra): only `pax lm-eval` and its function import this package.
"""
