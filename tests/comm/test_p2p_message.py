"""Pipeline messages without processes: pytree layout, metadata encoding, payload packing."""

import gc
import warnings
import weakref
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshpipe.comm.wire import (
    HEADER_NBYTES,
    PAYLOAD_ALIGNMENT,
    Header,
    MessageLayout,
    UnsupportedMessageError,
    _flatten_checked,
    describe_difference,
    flatten,
    host_message,
    new_buffer,
    pack,
    pack_into,
    tensor_paths,
    unflatten,
    unpack,
)

CPU = torch.device("cpu")


def assert_same_message(actual, expected, path="message"):
    """Exact equality of two messages: container types, keys, values, dtypes, shapes."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: {actual.shape} != {expected.shape}"
        assert torch.equal(actual.cpu(), expected.detach().cpu()), f"{path}: values differ"
        assert not actual.requires_grad, f"{path} arrived with requires_grad"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_message(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_message(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def roundtrip(message):
    layout, tensors = flatten(message)
    payload = pack(layout, tensors, CPU).clone()  # the wire copies the bytes
    return unpack(MessageLayout.decode(layout.encoded), payload)


def test_a_rich_message_round_trips_exactly():
    grad_input = torch.randn(2, 5, requires_grad=True)
    message = (
        grad_input * 2,
        {"lowp": torch.randn(5, 3).to(torch.bfloat16),
         "ids": torch.randint(0, 1000, (2, 5)),
         "mask": torch.rand(5) > 0.5,
         7: [None, 3, "text", 2.5, True, -0.0]},
        torch.randn(4, 6).t(),                       # non-contiguous
        torch.tensor(3.0, dtype=torch.float64),      # 0-dim
        torch.empty(0, 5),                           # no bytes
        torch.randn(3, dtype=torch.complex64),
        torch.randint(0, 255, (5,), dtype=torch.uint8),
        torch.randn(5).to(torch.float8_e4m3fn),
        [],
        {},
    )
    assert_same_message(roundtrip(message), message)


def test_bare_leaves_are_messages_too():
    for message in (torch.arange(6), None, 5, "s", 1.5, (), [None, None]):
        assert_same_message(roundtrip(message), message)


def test_received_tensors_are_contiguous_views_at_aligned_offsets():
    message = [torch.ones(3, dtype=torch.bool), torch.ones(5, dtype=torch.float16),
               torch.ones(2, dtype=torch.complex128), torch.ones(1, dtype=torch.int8)]
    layout, tensors = flatten(message)
    assert [slot.offset % PAYLOAD_ALIGNMENT for slot in layout.tensors] == [0, 0, 0, 0]
    ends = [slot.offset + slot.nbytes for slot in layout.tensors]
    assert all(end <= nxt.offset for end, nxt in zip(ends, layout.tensors[1:]))
    payload = pack(layout, tensors, CPU)
    assert payload.numel() == layout.payload_nbytes == ends[-1]
    received = unpack(layout, payload)
    assert all(t.is_contiguous() for t in received)
    assert {t.untyped_storage().data_ptr() for t in received} == {payload.data_ptr()}


def test_a_single_contiguous_tensor_is_sent_without_a_copy():
    tensor = torch.randn(4, 3, requires_grad=True)
    layout, tensors = flatten(tensor)
    assert pack(layout, tensors, CPU).data_ptr() == tensor.data_ptr()
    non_contiguous = torch.randn(4, 3).t()
    layout, tensors = flatten(non_contiguous)
    assert pack(layout, tensors, CPU).data_ptr() != non_contiguous.data_ptr()


def test_several_tensors_are_copied_into_one_buffer():
    a, b = torch.randn(3), torch.randn(2)
    layout, tensors = flatten((a, b))
    payload = pack(layout, tensors, CPU)
    a.fill_(0)
    assert not torch.equal(unpack(layout, payload)[0], a)


def test_a_message_packs_into_a_buffer_behind_a_header_and_stays_aligned():
    message = (torch.randn(3), {"ids": torch.arange(5), "c": torch.randn(2, dtype=torch.cdouble)})
    layout, tensors = flatten(message)
    header = 48  # the transport's header: a multiple of PAYLOAD_ALIGNMENT
    buffer = torch.zeros(header + layout.payload_nbytes, dtype=torch.uint8)
    pack_into(layout, tensors, buffer[header:])
    assert not buffer[:header].any()
    assert_same_message(unpack(layout, buffer[header:]), message)
    with pytest.raises(ValueError, match=f"at least {layout.payload_nbytes} bytes"):
        pack_into(layout, tensors, buffer[header + 1:])


def test_the_layout_depends_on_structure_shapes_dtypes_values_not_tensor_data():
    def encoded(message):
        return flatten(message)[0].encoded

    base = encoded((torch.zeros(2, 3), {"n": 1}))
    assert encoded((torch.ones(2, 3), {"n": 1})) == base
    assert encoded((torch.zeros(2, 4), {"n": 1})) != base
    assert encoded((torch.zeros(2, 3, dtype=torch.float64), {"n": 1})) != base
    assert encoded((torch.zeros(2, 3), {"n": 2})) != base
    assert encoded((torch.zeros(2, 3), {"m": 1})) != base
    assert encoded([torch.zeros(2, 3), {"n": 1}]) != base
    assert encoded((torch.zeros(2, 3), {"n": True})) != base


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still constructible
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize("bad, where", [
    ((torch.zeros(1), object()), "message[1]"),
    ({"a": {1, 2}}, "message['a']"),
    ([np.float32(1.0)], "message[0]"),
    (namedtuple("Pair", "x y")(1, 2), "message"),
    (OrderedDict(a=1), "message"),
    ({1.5: torch.zeros(1)}, "message"),
    ({"s": torch.zeros(3).to_sparse()}, "message['s']"),
    ([_quantized()], "message[0]"),
    ((torch.empty(2, device="meta"),), "message[0]"),
])
def test_unsupported_content_is_refused_with_its_path(bad, where):
    with pytest.raises(UnsupportedMessageError) as info:
        flatten(bad)
    assert str(info.value).startswith(where + " ")


@pytest.mark.parametrize("a, b, expected", [
    ((torch.zeros(2, 3),), (torch.zeros(2, 4),), "message[0] has shape [2, 3] in one and [2, 4]"),
    ({"x": torch.zeros(2)}, {"x": torch.zeros(2, dtype=torch.int64)},
     "message['x'] has dtype torch.float32 in one and torch.int64"),
    ((1, None), (2, None), "message[0] is 1 in one and 2 in the other"),
    ({"a": 1}, {"b": 1}, "message has keys ['a'] in one and ['b']"),
    ([1, 2], [1], "message has 2 items in one and 1 in the other"),
    ((torch.zeros(1),), (None,), "message[0] is a tensor in one and a value in the other"),
    ((1,), [1], "message is a tuple in one and a list in the other"),
])
def test_differences_between_layouts_are_described(a, b, expected):
    assert describe_difference(flatten(a)[0], flatten(b)[0]).startswith(expected)
    assert describe_difference(flatten(a)[0], flatten(a)[0]) is None


@pytest.mark.parametrize("data", [b"\xff\x00", b"[1, 2]", b'{"s": ["v", 1], "t": [["nope", [1]]]}',
                                  b'{"s": ["T"], "t": [["qint8", [2]]]}'])
def test_bytes_that_are_not_a_layout_are_refused(data):
    with pytest.raises(ValueError, match="do not decode"):
        MessageLayout.decode(data)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]
_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=False) | st.text(max_size=5))


@st.composite
def _tensors(draw):
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    dtype = draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 2**31))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    return values.to(dtype)


_messages = st.recursive(
    _tensors() | _scalars,
    lambda children: (st.lists(children, max_size=4)
                      | st.lists(children, max_size=4).map(tuple)
                      | st.dictionaries(st.text(max_size=3) | st.integers(-5, 5), children,
                                        max_size=4)),
    max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(_messages)
def test_any_message_round_trips_exactly(message):
    assert_same_message(roundtrip(message), message)


# -- the layout cache and the CPU buffers written and read through numpy ------------------

def _rich_message():
    return (torch.randn(2, 5, requires_grad=True) * 2,
            {"lowp": torch.randn(5, 3).to(torch.bfloat16), "ids": torch.arange(4),
             "mask": torch.rand(5) > 0.5, 7: [None, 3, "text", 2.5, True, -0.0]},
            torch.randn(4, 6).t(),
            torch.tensor(3.0, dtype=torch.float64),
            torch.empty(0, 5),
            torch.randn(3, dtype=torch.complex64).conj(),
            torch.randn(5).to(torch.float8_e4m3fn))


def test_a_repeated_signature_reuses_its_layout_and_equals_a_fresh_one():
    message = _rich_message()
    first, _ = flatten(message)
    again, tensors = flatten(_rich_message())
    assert again is first
    assert again == _flatten_checked(message)[0]
    assert [t.data_ptr() for t in tensors] != [t.data_ptr() for t in flatten(message)[1]]


@pytest.mark.parametrize("a, b", [
    ((1,), (True,)), ((1,), (1.0,)), ((0.0,), (-0.0,)), ({"1": 0}, {1: 0}),
    ((torch.zeros(2),), [torch.zeros(2)]), (torch.zeros(2), (torch.zeros(2),)),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}), ((torch.zeros(2, 3),), (torch.zeros(3, 2),)),
])
def test_messages_that_differ_in_layout_never_share_a_cached_one(a, b):
    flatten(a)
    assert flatten(b)[0].encoded == _flatten_checked(b)[0].encoded != flatten(a)[0].encoded


def test_a_nan_value_is_cached_like_any_other():
    first = flatten((float("nan"),))[0]
    assert flatten((float("nan"),))[0] is first


def test_unsupported_content_is_refused_after_a_similar_message_was_cached():
    flatten({"s": torch.zeros(3)})
    with pytest.raises(UnsupportedMessageError, match=r"^message\['s'\] "):
        flatten({"s": torch.zeros(3).to_sparse()})
    flatten([torch.ones(2)])
    with pytest.raises(UnsupportedMessageError, match=r"^message\[0\] "):
        flatten([_quantized()])


@pytest.mark.parametrize("cached", [False, True], ids=["checked", "cached"])
def test_flattening_and_rebuilding_a_message_leaves_its_tensors_to_reference_counting(cached):
    """No reference cycle keeps a message's tensors (a stage's activations and gradients)
    alive after the last reference goes: with the cyclic collector off, they are freed."""
    def message():
        return {"hidden": (torch.ones(2, 3), 1), "extra": [torch.zeros(4)]}

    if cached:
        flatten(message())
    gc.collect()
    gc.disable()
    try:
        sent = message()
        freed = [weakref.ref(t) for t in (sent["hidden"][0], sent["extra"][0])]
        layout, tensors = flatten(sent)
        assert tensor_paths(layout) == ["message['hidden'][0]", "message['extra'][0]"]
        rebuilt = unflatten(layout, tensors)
        assert rebuilt["extra"][0] is sent["extra"][0]
        del sent, tensors, rebuilt
        assert [ref() for ref in freed] == [None, None]
    finally:
        gc.enable()


def test_a_host_message_holds_the_header_then_the_packed_payload():
    message = _rich_message()
    layout, tensors = flatten(message)
    header = Header(3, -1, 0, layout.payload_nbytes, 11, 12)
    buffer = host_message(header, layout, tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == HEADER_NBYTES + layout.payload_nbytes
    assert Header.read_from(buffer) == header
    reference = torch.zeros(layout.payload_nbytes, dtype=torch.uint8)
    pack_into(layout, tensors, reference)
    for slot in layout.tensors:  # padding between tensors is left uninitialised
        start = HEADER_NBYTES + slot.offset
        assert torch.equal(buffer[start:start + slot.nbytes],
                           reference[slot.offset:slot.offset + slot.nbytes])


def test_a_message_reads_the_same_through_numpy_and_through_torch():
    message = _rich_message()
    layout, tensors = flatten(message)
    header = Header(0, -1, 0, layout.payload_nbytes, 0, 0)
    buffer, host = new_buffer(HEADER_NBYTES + layout.payload_nbytes, CPU)
    buffer.copy_(host_message(header, layout, tensors))
    assert Header.read_from(buffer, host) == header
    for received in (unpack(layout, buffer, HEADER_NBYTES, host),
                     unpack(layout, buffer, HEADER_NBYTES)):
        assert_same_message(received, message)


def test_a_lone_tensor_unpacks_to_itself():
    tensor = torch.randn(2, 3)
    layout, tensors = flatten(tensor)
    buffer, host = new_buffer(HEADER_NBYTES + layout.payload_nbytes, CPU)
    buffer.copy_(host_message(Header(0, -1, 0, 24, 0, 0), layout, tensors))
    assert torch.equal(unpack(layout, buffer, HEADER_NBYTES, host), tensor)


@settings(max_examples=60, deadline=None)
@given(_messages)
def test_any_message_has_its_fresh_layout_and_round_trips_through_numpy(message):
    layout, tensors = flatten(message)
    assert layout.encoded == _flatten_checked(message)[0].encoded
    buffer, host = new_buffer(HEADER_NBYTES + layout.payload_nbytes, CPU)
    buffer.copy_(host_message(Header(0, -1, 0, layout.payload_nbytes, 0, 0), layout, tensors))
    assert_same_message(unpack(layout, buffer, HEADER_NBYTES, host), message)
