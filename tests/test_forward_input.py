"""The step message tensor-parallel workers receive: round trip, and refusal of anything else; the
rendezvous store: loopback only, keys under the token."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from tokenmill.engine.scheduler_output import PromptLogprobsRequest, SamplingRequest, ScheduledSequence, SchedulerOutput
from tokenmill.executor.rendezvous import Rendezvous
from tokenmill.executor.tensor_parallel import SPEC_KEY, open_master_store
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.forward_input import ForwardInput, MalformedStepError


def test_round_trip():
    sampling = SamplingRequest(SamplingParams(), 0, [1], [], frozenset())
    output = SchedulerOutput([ScheduledSequence("a", [5, 6, 7], 0, [3], None),
                              ScheduledSequence("b", [9], 16, [4, 8], sampling)])
    batch = ForwardInput.from_scheduler_output(output)
    assert batch == ForwardInput([[5, 6, 7], [9]], [0, 16], [[3], [4, 8]], [False, True], [[0, 0], [0, 0]])
    assert ForwardInput.from_json(batch.to_json()) == batch
    scored = SchedulerOutput([ScheduledSequence("c", [5, 6, 7], 0, [3], sampling,
                                                PromptLogprobsRequest(1, [7], 2))])
    batch = ForwardInput.from_scheduler_output(scored)
    assert batch.prompt_logits == [[1, 1]] and batch.logits_rows() == [1, 2]
    assert ForwardInput.from_json(batch.to_json()) == batch


@pytest.mark.parametrize("payload", [
    b"", b"not json", b"{}", b"[]", b'[[], [], [], [], []]', b'[[[1]], [0], [[1]], [true], [[0, 0]], 5]',
    b'[[[1]], [0], [[1]], [true]]',  # four lists: the prompt-logits field is missing
    b'[[[1]], [0], [[1]], [1], [[0, 0]]]',  # needs_logits must be a boolean
    b'[[[1]], [0, 1], [[1]], [true], [[0, 0]]]',  # lengths disagree
    b'[[["x"]], [0], [[1]], [true], [[0, 0]]]', b'[[[1.5]], [0], [[1]], [true], [[0, 0]]]',
    b'[[[-1]], [0], [[1]], [true], [[0, 0]]]', b'[[[1]], [0], [[]], [true], [[0, 0]]]',
    b'[[[]], [0], [[1]], [true], [[0, 0]]]', b'[[[1]], [true], [[1]], [true], [[0, 0]]]',
    b'[[[1, 2]], [0], [[1]], [true], [[1, 2]]]',  # prompt logits rows past the sequence's tokens
    b'[[[1, 2]], [0], [[1]], [true], [[0]]]', b'[[[1, 2]], [0], [[1]], [true], [[-1, 1]]]',
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
