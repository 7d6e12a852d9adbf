import pytest
from hypothesis import given
from hypothesis import strategies as st
from tpujob_operator.tpu import ACCELERATORS, UnknownTpuShape, chips_in, slice_shape


@pytest.mark.parametrize(
    ("accelerator", "topology", "hosts", "chips_per_host"),
    [
        ("tpu-v5-lite-podslice", "1x1", 1, 1),
        ("tpu-v5-lite-podslice", "2x2", 1, 4),
        ("tpu-v5-lite-podslice", "2x4", 1, 8),  # ct5lp-hightpu-8t: one 8-chip host
        ("tpu-v5-lite-podslice", "4x4", 4, 4),
        ("tpu-v5-lite-podslice", "16x16", 64, 4),
        ("tpu-v6e-slice", "4x4", 4, 4),
        ("tpu-v6e-slice", "8x16", 32, 4),
        ("tpu-v5p-slice", "2x2x1", 1, 4),
        ("tpu-v5p-slice", "2x2x2", 2, 4),
        ("tpu-v5p-slice", "4x4x8", 32, 4),  # v5p-256
        ("tpu-v4-podslice", "2x2x4", 4, 4),
    ],
)
def test_hosts_and_chips_follow_gke_machine_shapes(accelerator, topology, hosts, chips_per_host):
    shape = slice_shape(accelerator, topology)
    assert (shape.hosts, shape.chips_per_host) == (hosts, chips_per_host)
    assert shape.hosts * shape.chips_per_host == chips_in(topology)


@pytest.mark.parametrize(
    ("accelerator", "topology", "message"),
    [
        ("tpu-v9-imaginary", "2x2", "unknown TPU accelerator"),
        ("tpu-v5p-slice", "4x4", "not offered for tpu-v5p-slice"),  # 2-D shape on a 3-D torus
        ("tpu-v6e-slice", "2x2x2", "not offered for tpu-v6e-slice"),
        ("tpu-v5-lite-podslice", "3x3", "not offered"),
    ],
)
def test_shapes_gke_does_not_offer_are_refused(accelerator, topology, message):
    with pytest.raises(UnknownTpuShape, match=message):
        slice_shape(accelerator, topology)


@given(st.sampled_from([(a, t) for a, f in ACCELERATORS.items() for t in f.topologies]))
def test_every_offered_shape_splits_evenly_into_hosts(pair):
    shape = slice_shape(*pair)
    assert shape.hosts >= 1
    assert shape.chips_per_host in (1, 4, 8)
    assert shape.hosts * shape.chips_per_host == shape.chips
