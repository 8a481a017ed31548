"""The wire between a server and its engine process: typed msgpack (msgspec), never pickle.

Every message is two ZeroMQ frames, [kind, payload]. A payload decodes only into the dataclass
its kind names, so nothing on the wire can make the reader build anything else. Errors travel
as their class name, message and param; the reader rebuilds tokenmill's own error classes and
turns anything else into a plain RuntimeError (whose text the server never shows a client).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tokenmill import errors
from tokenmill.engine.device_peaks import DevicePeaks
from tokenmill.engine.engine_info import EngineInfo
from tokenmill.engine.engine_loop import AddCommand, StepResult

# server -> engine
ADD = b"add"  # AddCommand
ABORT = b"abort"  # the request id, a str
STOP = b"stop"  # no payload: finish the queued commands, then exit
# engine -> server
READY = b"ready"  # EngineInfo: the model is loaded
STEP = b"step"  # StepResult
PEAKS = b"peaks"  # DevicePeaks: the CPU was measured
DEAD = b"dead"  # WireError: the engine cannot go on (it exits with status 1)
FAILED = b"failed"  # WireError: the engine could not start


@dataclass
class WireError:
    type: str
    message: str
    param: str | None = None


def to_wire_error(exc: BaseException) -> WireError:
    message = exc.message if isinstance(exc, errors.TokenmillError) else str(exc)
    return WireError(type(exc).__name__, message, getattr(exc, "param", None))


def from_wire_error(wire: WireError) -> BaseException:
    cls = getattr(errors, wire.type, None)
    if isinstance(cls, type) and issubclass(cls, errors.TokenmillError):
        return cls(wire.message, param=wire.param)
    return RuntimeError(f"{wire.type}: {wire.message}")


def _enc_hook(obj):
    if isinstance(obj, BaseException):
        return to_wire_error(obj)
    raise NotImplementedError(f"{type(obj).__name__} cannot go on the engine wire")


def _dec_hook(typ, obj):
    if typ is BaseException:
        return from_wire_error(msgspec.convert(obj, WireError))
    raise NotImplementedError(f"{typ} cannot come off the engine wire")


PAYLOAD_TYPES: dict[bytes, type] = {
    ADD: AddCommand, ABORT: str, READY: EngineInfo, STEP: StepResult, PEAKS: DevicePeaks,
    DEAD: WireError, FAILED: WireError,
}


class Codec:
    """Encode any payload; decode a payload by its message kind (one typed decoder per kind)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoders = {kind: msgspec.msgpack.Decoder(typ, dec_hook=_dec_hook) for kind, typ in PAYLOAD_TYPES.items()}

    def encode(self, kind: bytes, payload=None) -> list[bytes]:
        return [kind, b"" if payload is None else self._encoder.encode(payload)]

    def decode(self, kind: bytes, payload: bytes):
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise ValueError(f"unknown engine message {kind[:16]!r}")
        return decoder.decode(payload)
