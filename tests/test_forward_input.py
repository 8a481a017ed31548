"""The step message tensor-parallel workers receive: round trip, and refusal of anything else; the
rendezvous store: loopback only, keys under the token."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from tokenmill.engine.scheduler_output import SamplingRequest, ScheduledSequence, SchedulerOutput
from tokenmill.executor.tensor_parallel import SPEC_KEY, Rendezvous, open_master_store
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.forward_input import ForwardInput, MalformedStepError


def test_round_trip():
    sampling = SamplingRequest(SamplingParams(), 0, [1], [], frozenset())
    output = SchedulerOutput([ScheduledSequence("a", [5, 6, 7], 0, [3], None),
                              ScheduledSequence("b", [9], 16, [4, 8], sampling)])
    batch = ForwardInput.from_scheduler_output(output)
    assert batch == ForwardInput([[5, 6, 7], [9]], [0, 16], [[3], [4, 8]], [False, True])
    assert ForwardInput.from_json(batch.to_json()) == batch


@pytest.mark.parametrize("payload", [
    b"", b"not json", b"{}", b"[]", b'[[], [], [], []]', b'[[[1]], [0], [[1]], [true], 5]',
    b'[[[1]], [0], [[1]], [1]]',  # needs_logits must be a boolean
    b'[[[1]], [0, 1], [[1]], [true]]',  # lengths disagree
    b'[[["x"]], [0], [[1]], [true]]', b'[[[1.5]], [0], [[1]], [true]]', b'[[[-1]], [0], [[1]], [true]]',
    b'[[[1]], [0], [[]], [true]]', b'[[[]], [0], [[1]], [true]]', b'[[[1]], [true], [[1]], [true]]',
    b'{"__class__": "os.system"}', b"\x80\x04\x95",  # a pickle's first bytes
])
def test_malformed_step_messages_are_refused(payload):
    with pytest.raises(MalformedStepError):
        ForwardInput.from_json(payload)


def test_the_store_listens_on_loopback_with_keys_under_the_token():
    rendezvous = Rendezvous("127.0.0.1", 0, 2, token="s3cret")
    store, listener = open_master_store(rendezvous)
    try:
        assert listener.getsockname()[0] == "127.0.0.1" and rendezvous.port > 0
        store.set(SPEC_KEY, "{}")
        outsider = dist.TCPStore("127.0.0.1", rendezvous.port, 2, is_master=False, timeout=timedelta(seconds=5))
        assert not outsider.check([SPEC_KEY]) and not outsider.check([f"tokenmill//{SPEC_KEY}"])
        assert outsider.check([f"tokenmill/s3cret/{SPEC_KEY}"])  # only with the token
    finally:
        listener.close()
