"""Decoding: `pax decode` and decoding while training; each module imports only those above it.

  options     DecodeOptions and command-line text checks (no JAX: checked before start-up)
  prompts     Prompt; prompts from --prompt, --prompt-ids, a prompts file, an input, DECODE_PROMPTS
  decoder     Decoder: the model's init_cache/extend compiled on the mesh; greedy, sampling, beam
  output      the JSONL files under <job dir>/decoder_out
  command     decode(): config, job directory and options in, records out (what `pax decode` runs)
  training    TrainDecoder: DECODE_PROMPTS at DECODE_INTERVAL_STEPS, for the train loop
  reference   the plain forward pass cached decoding must agree with (for tests)
"""
