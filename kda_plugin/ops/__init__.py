"""KDA ops: the reference recurrence, the chunked training form, the decode step, gates and conv.

Batch-first layout: `q, k, g [B, T, H, K]`, `v [B, T, H, V]`, `beta [B, T, H]`, states float32
`[B, H, K, V]` (or `[B, N, H, K, V]` per segment slot with `segment_ids`). See
docs/kda.md for the math and docs/packing.md for the packing contract.
"""

from kda_plugin.ops.chunked import kda_chunked
from kda_plugin.ops.decode import kda_decode_step
from kda_plugin.ops.gates import activate_gate, kda_gate_bounded, kda_gate_softplus, l2norm
from kda_plugin.ops.inference import estimate_peak_memory, kda_inference
from kda_plugin.ops.reference import kda_reference
from kda_plugin.ops.short_conv import short_conv, short_conv_step

__all__ = [
    "activate_gate",
    "estimate_peak_memory",
    "kda_chunked",
    "kda_decode_step",
    "kda_gate_bounded",
    "kda_gate_softplus",
    "kda_inference",
    "kda_reference",
    "l2norm",
    "short_conv",
    "short_conv_step",
]
