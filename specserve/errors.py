"""Exceptions the library raises for bad input; each message names the problem."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError

    from specserve.sequence import RequestOutput


def settings_problems(e: ValidationError, *, as_flags: bool = False, flags: Mapping[str, str] | None = None) -> str:
    """A settings error on one line: each field (``--its-flag`` with ``as_flags``; the flag ``flags`` names for it
    where a flag's name is not the field's) and what is wrong with it."""

    def describe(loc: tuple[int | str, ...], msg: str) -> str:
        msg = msg.removeprefix("Value error, ")
        if not loc:  # a check across fields: its message names them
            return msg
        if flags is not None and loc[0] in flags:
            return f"{flags[str(loc[0])]}: {msg}"
        return f"--{str(loc[0]).replace('_', '-')}: {msg}" if as_flags else f"{'.'.join(map(str, loc))}: {msg}"

    return "; ".join(dict.fromkeys(describe(err["loc"], err["msg"]) for err in e.errors()))


class SpecServeError(Exception):
    """Base class of every error specserve raises on purpose."""


class ModelSourceError(SpecServeError):
    """A model could not be found, fetched, verified or converted."""


class UnknownModelError(ModelSourceError):
    pass


class CorruptModelError(ModelSourceError):
    pass


class NonFiniteWeightsError(CorruptModelError):
    """Weights that hold NaN or infinities: the checkpoint's own (converting it again cannot help)."""


class HubUnreachableError(ModelSourceError):
    pass


class UnsupportedModelError(SpecServeError):
    """The checkpoint's architecture or options are outside the Llama family this runner implements."""


class KVCapacityError(SpecServeError):
    """A sequence would exceed its KV slot, or no slot is free."""


class SettingsError(SpecServeError, ValueError):
    """Settings the library cannot run with, or that contradict each other; the message names them."""


class TrainingDivergedError(SpecServeError):
    """A training step's loss or gradient is not finite; the step is not applied and the last checkpoint stands."""


class InvalidRequestError(SpecServeError, ValueError):
    """A request's prompt or sampling values are invalid; ``param`` names the field at fault, where one is."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (across Ray) with its keyword fields
        return (_rebuilt, (type(self), self.args, vars(self)))


class PromptTooLongError(InvalidRequestError):
    """A prompt that cannot fit the room it is given, found before it is tokenized: it has at least ``fewest``
    tokens. ``item``: its index in a batch of prompts, where it is one."""

    def __init__(self, message: str, *, param: str, fewest: int, item: int | None = None) -> None:
        super().__init__(message, param=param)
        self.fewest = fewest
        self.item = item


class SequenceError(SpecServeError):
    """A worker's failure pinned on one sequence: that sequence alone is failed; the rest of its batch goes on."""

    def __init__(self, seq_id: int, message: str) -> None:
        super().__init__(f"sequence {seq_id}: {message}")
        self.seq_id = seq_id
        self.message = message

    def __reduce__(self) -> tuple[type[SequenceError], tuple[int, str]]:  # pickles across Ray with its seq_id
        return (SequenceError, (self.seq_id, self.message))


class PartialStepError(SpecServeError):
    """A step that verified every sequence but failed some in their commit (their detokenisation, say) or after it
    (their SL update): ``outputs`` are what the step committed, to be delivered first; ``failures`` the sequences
    to fail alone."""

    def __init__(self, outputs: list[RequestOutput], failures: dict[int, SequenceError]) -> None:
        super().__init__(f"{len(failures)} sequence(s) failed in a step: " + "; ".join(map(str, failures.values())))
        self.outputs = outputs
        self.failures = failures

    def __reduce__(self) -> tuple[Any, ...]:
        return (PartialStepError, (self.outputs, self.failures))


def _rebuilt(cls: type[Exception], args: tuple[Any, ...], fields: dict[str, Any]) -> Exception:
    """An error as pickled: its message arguments, then its fields set as they were (not passed to ``__init__``,
    whose keyword-only fields its ``args`` leave out)."""
    error = Exception.__new__(cls)
    error.args = args
    vars(error).update(fields)
    return error


MAX_CAUSE_DEPTH = 8


def blamed_sequence(error: BaseException) -> int | None:
    """The seq_id a failure names: a SequenceError itself, or one carried as the cause of a wrapper (Ray's
    RayTaskError keeps it in ``.cause``; ``raise ... from`` in ``__cause__``); None when nothing names one."""
    seen: BaseException | None = error
    for _ in range(MAX_CAUSE_DEPTH):
        if seen is None:
            return None
        if isinstance(seen, SequenceError):
            return seen.seq_id
        cause = getattr(seen, "cause", None)
        seen = cause if isinstance(cause, BaseException) else seen.__cause__
    return None


@contextmanager
def blame(seq_id: int) -> Iterator[None]:
    """Pin any exception raised inside on ``seq_id``: it leaves as a SequenceError chained to the original."""
    try:
        yield
    except SequenceError:
        raise
    except Exception as e:
        raise SequenceError(seq_id, f"{type(e).__name__}: {e}") from e
