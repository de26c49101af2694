"""Shared by the MaxText import tests: fixture scripts and the seed's translation table."""

import pathlib

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'maxtext'

# Pax's README table "MaxText to Pax" for C4Spmd22BAdam2xv4_128, as it stands.
SEED_2XV4_128 = {
    'NUM_LAYERS': 48, 'MODEL_DIMS': 6144, 'HIDDEN_DIMS': 24576, 'NUM_HEADS': 24,
    'DIMS_PER_HEAD': 256, 'PERCORE_BATCH_SIZE': 16, 'MAX_SEQ_LEN': 1024, 'VOCAB_SIZE': 32768,
    'FPROP_DTYPE': 'bfloat16', 'USE_REPEATED_LAYER': True, 'SUMMARY_INTERVAL_STEPS': 10,
    'ICI_MESH_SHAPE': [1, 64, 1], 'DCN_MESH_SHAPE': [2, 1, 1],
}
