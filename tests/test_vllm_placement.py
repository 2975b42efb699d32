"""The placement tracer and its affine inverse, without vLLM: any module with a ``load_weights``.

vLLM's loaders copy narrowed/sliced/transposed views of the checkpoint tensor into slices of
resident parameters. A loader written here the same way checks that the traced map agrees with
the copy the loader would really make, element for element, and that value transforms are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_cli.errors import IncompatibleError
from dcr_cli.receive.vllm.placement import flat_storage, trace_placement


class ViewLoader(torch.nn.Module):
    """Copies ``view(checkpoint_tensor)`` into ``param`` at ``offset`` (like a fused or sharded loader)."""

    def __init__(self, resident: int, view, offset: int, transform=None) -> None:
        super().__init__()
        self.param = torch.nn.Parameter(torch.zeros(resident, dtype=torch.bfloat16), requires_grad=False)
        self.view, self.offset, self.transform = view, offset, transform

    def load_weights(self, weights) -> None:
        for _, tensor in weights:
            src = self.view(tensor)
            if self.transform is not None:
                src = self.transform(src)
            dst = self.param.data[self.offset : self.offset + src.numel()].view(src.shape)
            dst.copy_(src)


VIEWS = {
    "whole": lambda t: t,
    "rows": lambda t: t.narrow(0, 2, 3),
    "columns": lambda t: t.narrow(1, 1, 4),  # row-parallel shard: a strided box
    "transpose": lambda t: t.t(),
    "step": lambda t: t[::2, 1::3],
}


@settings(max_examples=25, deadline=None)
@given(view=st.sampled_from(sorted(VIEWS)), offset=st.integers(0, 20), seed=st.integers(0, 2**31 - 1))
def test_traced_map_matches_the_copy_the_loader_makes(view, offset, seed):
    shape = (7, 9)
    module = ViewLoader(200, VIEWS[view], offset)
    placement = trace_placement(module, "w", shape, torch.bfloat16)
    assert torch.count_nonzero(module.param.view(torch.int16)) == 0  # tracing wrote nothing

    # The real copy, with distinct bit patterns, tells where each canonical element lands.
    checkpoint = torch.arange(1, 64, dtype=torch.int16)[: 7 * 9].reshape(shape).view(torch.bfloat16)
    module.load_weights([("w", checkpoint)])
    landed = flat_storage(module.param).numpy()
    (dest,) = placement.destinations
    rng = np.random.default_rng(seed)
    canonical = rng.permutation(7 * 9)[: rng.integers(1, 7 * 9)].astype(np.int64)
    hit, index = dest.locate(canonical)
    expected_hit = np.isin(canonical + 1, landed)  # value k + 1 is canonical element k
    assert np.array_equal(hit, expected_hit)
    assert np.array_equal(landed[index], canonical[hit] + 1)


def test_padding_fill_is_not_a_destination():
    class PaddedEmbedding(ViewLoader):
        def load_weights(self, weights):
            super().load_weights(weights)
            self.param.data[100:].fill_(0)

    placement = trace_placement(PaddedEmbedding(120, VIEWS["whole"], 0), "w", (7, 9), torch.bfloat16)
    assert len(placement.destinations) == 1


@pytest.mark.parametrize(
    ("transform", "message"),
    [
        (lambda t: t.contiguous().clone(), "not a view of the input"),
        (lambda t: t * 2, "not a view of the input"),
        (lambda t: t.to(torch.float16).to(torch.bfloat16), "not a view of the input"),
    ],
)
def test_value_transforms_are_refused(transform, message):
    with pytest.raises(IncompatibleError, match=message):
        trace_placement(ViewLoader(100, VIEWS["rows"], 0, transform), "w", (7, 9), torch.bfloat16)


def test_narrowing_cast_is_refused_and_widening_is_marked():
    class CastLoader(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.param = torch.nn.Parameter(torch.zeros(63, dtype=dtype), requires_grad=False)

        def load_weights(self, weights):
            for _, tensor in weights:
                self.param.data.view(7, 9).copy_(tensor)

    with pytest.raises(IncompatibleError, match=r"casts torch\.bfloat16 to torch\.float16"):
        trace_placement(CastLoader(torch.float16), "w", (7, 9), torch.bfloat16)
    (dest,) = trace_placement(CastLoader(torch.float32), "w", (7, 9), torch.bfloat16).destinations
    assert dest.cast(torch.bfloat16) and dest.dst_dtype == torch.float32


def test_replaced_parameter_is_refused():
    class Reassigning(ViewLoader):
        def load_weights(self, weights):
            for _, tensor in weights:
                self.param = torch.nn.Parameter(tensor.reshape(-1).clone(), requires_grad=False)

    with pytest.raises(IncompatibleError, match="replaced parameter"):
        trace_placement(Reassigning(63, VIEWS["whole"], 0), "w", (7, 9), torch.bfloat16)


def test_meta_parameters_mean_a_layer_wise_reload():
    module = ViewLoader(63, VIEWS["whole"], 0)
    module.param = torch.nn.Parameter(torch.empty(63, dtype=torch.bfloat16, device="meta"), requires_grad=False)
    with pytest.raises(IncompatibleError, match="layer-wise reload"):
        trace_placement(module, "w", (7, 9), torch.bfloat16)
