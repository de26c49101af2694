"""Scoring: `pax score`, the log-likelihood of given continuations (lm-evaluation-harness'
`loglikelihood` and `loglikelihood_rolling` requests); each module imports only those above it.

  requests    the JSONL requests file, checked before start-up, and its requests as token pairs
  scorer      Scorer: the model's forward pass compiled on the mesh; token logprobs and greedy flags
  command     score(): config, job directory and requests file in, records out (what `pax score` runs)
"""
