import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from services.engine import synth


def slow_hashes(tokens):
    out, h = [], 0
    for t in tokens:
        h = synth.extend_hash(h, t)
        out.append(h)
    return out


@given(st.lists(st.integers(0, 1 << 20), max_size=300))
def test_vectorised_rolling_hash_equals_the_sequential_one(tokens):
    assert [int(x) for x in synth.prefix_hashes(tokens)] == slow_hashes(tokens)


def test_hash_of_a_position_depends_only_on_the_prefix():
    a = synth.prefix_hashes([5, 6, 7, 8])
    b = synth.prefix_hashes([5, 6, 7, 9, 10])
    assert list(a[:3]) == list(b[:3])
    assert a[3] != b[3]


def test_layer_kv_is_deterministic_and_distinct():
    h = synth.prefix_hashes(list(range(64)))
    k0 = synth.layer_kv(h, 0, 128, np.float32)
    assert k0.shape == (2, 64, 128) and k0.dtype == np.float32
    np.testing.assert_array_equal(k0, synth.layer_kv(h.copy(), 0, 128, np.dtype("float32")))
    # a token's KV does not depend on how many tokens were computed with it
    np.testing.assert_array_equal(k0[:, 10:20], synth.layer_kv(h[10:20], 0, 128, np.float32))
    assert not np.array_equal(k0, synth.layer_kv(h, 1, 128, np.float32))
    assert not np.array_equal(k0[0], k0[1])  # K differs from V
    assert np.all((k0 >= -0.5) & (k0 < 0.5))
    assert len(np.unique(k0[0, :, 0])) == 64  # every position differs
    assert synth.layer_kv(h, 0, 128, np.float16).dtype == np.float16
    assert synth.layer_kv(h, 0, 128, np.uint16).dtype == np.uint16


@given(
    st.lists(st.integers(0, 1 << 20), min_size=1, max_size=80),
    st.integers(1, 40),
    st.sampled_from([8, 64, 128]),
    st.sampled_from(["float32", "float16", "uint16"]),
)
def test_all_layers_at_once_are_each_layers_bytes(tokens, layers, row, dtype):
    h = synth.prefix_hashes(tokens)
    every = synth.layers_kv(h, layers, row, np.dtype(dtype))
    assert every.shape == (layers, 2, len(tokens), row) and every.dtype == np.dtype(dtype)
    for layer in range(layers):
        assert every[layer].tobytes() == synth.layer_kv(h, layer, row, np.dtype(dtype)).tobytes()


def test_next_token_avoids_eos_and_reference_generate_chains():
    prompt = [1, 2, 3]
    toks = synth.reference_generate(prompt, 50, vocab_size=16, eos_token_id=2)
    assert len(toks) == 50 and 2 not in toks and all(0 <= t < 16 for t in toks)
    # the reference is a pure function of the sequence so far
    assert synth.reference_generate(prompt + toks[:10], 40, 16, 2) == toks[10:]


def test_first_mismatch_reports_the_token_position():
    a = np.zeros((2, 8, 4), np.float32)
    b = a.copy()
    assert synth.first_mismatch(a, b) is None
    b[1, 5, 3] = 1.0
    assert synth.first_mismatch(a, b) == 5
