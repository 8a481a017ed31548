"""From the requests a step advanced to RequestOutputs: detokenization, stop strings, the n
samples of one request, and what each output holds (OutputKind)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.outputs import CompletionOutput, Logprob, OutputKind, PromptLogprobs, RequestMetrics, RequestOutput


@dataclass
class _Group:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    kind: OutputKind
    num_reported: list[int]  # DELTA: tokens of each sample already sent
    sent_prompt_logprobs: bool = False  # DELTA: the prompt logprobs went out

    @property
    def is_finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class OutputProcessor:
    """Turns tokens into outputs; ends a request on a stop string (through the scheduler)."""

    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, tuple[_Group, int]] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request], kind: OutputKind) -> None:
        prompt_token_ids = children[0].prompt_token_ids
        detokenizers = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, c.sampling_params) for c in children]
        group = _Group(request_id, prompt, prompt_token_ids, children, detokenizers, kind, [0] * len(children))
        self.groups[request_id] = group
        for index, child in enumerate(children):
            self._child_to_group[child.request_id] = (group, index)

    def process(self, updated: list[Request]) -> list[RequestOutput]:
        """Outputs for the requests that got a token this step (finished ones included)."""
        texts_by_group: dict[str, dict[int, str]] = {}
        for request in updated:
            group, index = self._child_to_group[request.request_id]
            detokenizer = group.detokenizers[index]
            if not request.output_token_ids:  # max_tokens 0: the prompt only
                text = detokenizer.finish()
            elif request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids[-1] in request.stop_token_ids:
                text = detokenizer.finish()  # the stop or EOS token adds no text
            else:
                text = detokenizer.add_token(request.output_token_ids[-1], flush=request.is_finished)
                if detokenizer.stop_string is not None:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    # also when the length limit already ended it on the token that completed the stop string
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, detokenizer.stop_string
            if request.logprobs:
                self._decode_logprobs(request.logprobs[-1])
            texts_by_group.setdefault(group.request_id, {})[index] = text
        outputs = []
        for group_id, texts in texts_by_group.items():
            output = self._output(self.groups[group_id], texts)
            if output is not None:
                outputs.append(output)
        return outputs

    def finish(self, request_id: str, error: BaseException | None = None) -> RequestOutput | None:
        """The final output of a request whose samples the scheduler has all ended (abort, failure)."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        output = self._output(group, {})
        if output is not None:
            output.error = error
        return output

    def _decode_logprobs(self, entry: dict[int, Logprob]) -> None:
        for token_id, logprob in entry.items():
            if logprob.decoded_token is None:
                logprob.decoded_token = self.tokenizer.decode([token_id])

    def _prompt_logprobs(self, group: _Group) -> PromptLogprobs | None:
        """The prompt logprobs of the group (its first sample scores the prompt), decoded, once its
        prompt is scored; with DELTA outputs only in the first output after that."""
        scored = group.children[0].prompt_logprobs
        if scored is None or len(scored) < len(group.prompt_token_ids) or group.sent_prompt_logprobs:
            return None
        for entry in scored[1:]:
            self._decode_logprobs(entry)
        group.sent_prompt_logprobs = group.kind is OutputKind.DELTA
        return scored

    def _output(self, group: _Group, texts: dict[int, str]) -> RequestOutput | None:
        """This step's output of the group (None for FINAL_ONLY before the end); forgets it when done."""
        finished = group.is_finished
        if finished:
            for index, detokenizer in enumerate(group.detokenizers):
                rest = detokenizer.finish()
                if rest:
                    texts[index] = texts.get(index, "") + rest
            del self.groups[group.request_id]
            for child in group.children:
                del self._child_to_group[child.request_id]
        elif group.kind is OutputKind.FINAL_ONLY:
            return None
        samples = []
        for index, (child, detokenizer) in enumerate(zip(group.children, group.detokenizers)):
            if group.kind is OutputKind.DELTA:
                start, group.num_reported[index] = group.num_reported[index], child.num_output_tokens
                text, token_ids = texts.get(index, ""), child.output_token_ids[start:]
                logprobs = None if child.logprobs is None else child.logprobs[start:]
            else:
                text, token_ids = detokenizer.text[: detokenizer.num_emitted], list(child.output_token_ids)
                logprobs = child.logprobs
            samples.append(CompletionOutput(index=child.index, text=text, token_ids=token_ids,
                                            finish_reason=child.status.finish_reason, stop_reason=child.stop_reason,
                                            logprobs=logprobs))
        return RequestOutput(request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                             outputs=samples, finished=finished, metrics=_group_metrics(group.children),
                             num_cached_tokens=group.children[0].num_cached_tokens,
                             prompt_logprobs=self._prompt_logprobs(group))


def _group_metrics(children: list[Request]) -> RequestMetrics:
    first = children[0].metrics

    def earliest(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    finished = [c.metrics.finished_time for c in children]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=earliest(c.metrics.first_scheduled_time for c in children),
        first_token_time=earliest(c.metrics.first_token_time for c in children),
        finished_time=None if None in finished else max(finished),
        num_preemptions=sum(c.metrics.num_preemptions for c in children),
    )
