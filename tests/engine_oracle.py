"""An independent oracle for token fidelity: what the engine itself emitted, per request.

`RecordingEngine` wraps any Engine at the protocol boundary (local, a Router of SGLang clients,
a Ray handle) and logs every request the gateway makes: the input ids sent, and the ids,
behaviour log-probs and weight versions of every chunk the engine yielded, with the finish
reason. It shares no code with the gateway's turn log, `build_segments` or the trainer.

`check_trajectory` reads a trajectory against those records, not against itself: every run of
loss-masked tokens in a segment must be the complete output of one engine request whose input
ids are exactly the segment's tokens before it (ids, logprobs and versions equal), each request
is used at most once, and a segment is exactly the input + output of the last request in it, so
every unmasked token is a token the gateway sent to the engine (tool results, template tokens)
and never one it trained on.

`ScriptedEngine` is an engine whose output is given: tests that need a model to write exactly
some ids (a tool call, a token split no tokenizer would produce) script them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.engines.base import Chunk, DelegatingEngine, Engine, SamplingParams
from gateway.trajectory import Trajectory


@dataclass
class Record:
    """One engine request, as the engine answered it."""

    request_id: str | None
    session_id: str | None
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """None when the caller stopped reading before the last chunk."""


class RecordingEngine(DelegatingEngine):
    """An Engine that forwards everything to `inner` and records each generation request
    (`generate` goes through `stream`: `DelegatingEngine`)."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.records: list[Record] = []

    async def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        record = Record(request_id, session_id, list(input_ids))
        self.records.append(record)
        inner = self.inner.stream(input_ids, params, request_id, session_id)
        try:
            async for chunk in inner:
                record.output_ids += chunk.token_ids
                record.logprobs += chunk.logprobs
                record.versions += chunk.versions
                record.finish_reason = chunk.finish_reason or record.finish_reason
                yield chunk
        finally:
            await inner.aclose()  # type: ignore[attr-defined]

    def of_session(self, session_id: str) -> list[Record]:
        return [r for r in self.records if r.session_id == session_id]


class ScriptedEngine(Engine):
    """Replays `script` token ids for every request: `length` at max_tokens, else `stop`."""

    weight_version = 0
    max_context = 4096
    load = 0

    def __init__(self) -> None:
        self.script: list[int] = []

    async def stream(self, ids, params: SamplingParams, request_id=None, session_id=None):
        out = self.script[: params.max_tokens]
        for i, t in enumerate(out):
            last = i == len(out) - 1
            finish = ("length" if len(out) < len(self.script) else "stop") if last else None
            yield Chunk([t], [-0.5], [0], finish)

    async def abort(self, request_id):
        pass

    async def health(self):
        return True


def check_trajectory(traj: Trajectory, records: list[Record]) -> list[Record]:
    """Assert that `traj`'s segments are made of what the engine emitted (module docstring);
    return the records they use, in segment order."""
    used: list[Record] = []
    for s, seg in enumerate(traj.segments):
        check_sequence(seg.token_ids, seg.loss_mask, seg.logprobs, records, used, f"segment {s}",
                       versions=seg.versions)  # fmt: skip
    return used


def check_sequence(
    ids: list[int],
    mask: list[int],
    logprobs: list[float],
    records: list[Record],
    used: list[Record],
    where: str = "sequence",
    versions: list[int] | None = None,
) -> None:
    """Check one training sequence (and its per-token `versions`, when given: the engine's on
    trained tokens, -1 elsewhere) against the records; append the records it uses to `used`."""
    assert len(ids) == len(mask) == len(logprobs), f"{where}: lengths differ"
    if versions is not None:
        assert len(versions) == len(ids), f"{where}: versions differ in length"
    last: Record | None = None
    i = 0
    while i < len(ids):
        if not mask[i]:
            assert versions is None or versions[i] == -1, f"{where}: version on untrained {i}"
            i += 1
            continue
        match = next(
            (
                r
                for r in records
                if r.output_ids
                and not any(r is u for u in used)
                and r.input_ids == ids[:i]
                and r.output_ids == ids[i : i + len(r.output_ids)]
            ),
            None,
        )
        assert match is not None, f"{where}: trained tokens at {i} are no engine output there"
        end = i + len(match.output_ids)
        assert all(mask[i:end]), f"{where}: part of an engine output at {i} is not trained"
        assert logprobs[i:end] == match.logprobs, f"{where}: logprobs at {i}"
        assert versions is None or versions[i:end] == match.versions, f"{where}: versions at {i}"
        used.append(match)
        last, i = match, end
    assert last is not None, f"{where} has no trained token"
    assert ids == last.input_ids + last.output_ids, (
        f"{where} does not end with the engine output of its last request"
    )


def assert_token_in_token_out(records: list[Record]) -> None:
    """Each request of an append-only session extends the previous request's input + output
    (the ids the engine emitted are sent back verbatim, never re-encoded from text)."""
    for prev, rec in zip(records, records[1:], strict=False):
        sent = prev.input_ids + prev.output_ids
        assert rec.input_ids[: len(sent)] == sent, (
            f"request {rec.request_id} does not extend {prev.request_id}'s tokens"
        )
