"""Errors the HTTP layer maps to OpenAI-style error bodies; each carries its status and error type."""

from __future__ import annotations

from http import HTTPStatus

from specserve.api.schemas import ErrorCode, ErrorDetail, ErrorResponse, ErrorType
from specserve.errors import SpecServeError


class APIError(SpecServeError):
    status: HTTPStatus = HTTPStatus.BAD_REQUEST
    type: ErrorType = ErrorType.invalid_request
    code: ErrorCode | None = ErrorCode.invalid_value
    retryable: bool | None = None  # False: answered with x-should-retry: false (None: the client's own rule)

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> ErrorResponse:
        return error_body(str(self), self.type, code=self.code, param=self.param)


class ModelNotFoundError(APIError):
    status = HTTPStatus.NOT_FOUND
    type = ErrorType.not_found
    code = ErrorCode.model_not_found


class ContextLengthError(APIError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context (``param`` names which)."""

    code = ErrorCode.context_length_exceeded


class OverloadedError(APIError):
    """The router's queue is full: the client should retry after ``retry_after_s``."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    type = ErrorType.rate_limit
    code = ErrorCode.rate_limit_exceeded

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerFailedError(APIError):
    """A lane lost a worker and could not bring it back."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    type = ErrorType.unavailable
    code = ErrorCode.worker_failed


class LaneLostError(WorkerFailedError):
    """A lane stopped, or lost its workers and could not bring them back: its requests may run on another lane
    (``deployments/failover.py``); the same 503 body when none can take them."""


class StepLostError(LaneLostError):
    """The lane's target died in a step this request was part of and the culprit is not found yet: a failover like
    any lost lane's, and the next lane steps the request alone before it joins a batch (``Request.suspect``)."""


class LaneHandoffError(LaneLostError):
    """A lane still starting its workers hands a request it holds, run no further there since the loss, to a lane
    that has its model, or a lane that lost its target in a step the request was not part of (a suspect's, alone)
    hands it on: a move at no fault of the request's, so not a failover counted against ``max_failovers``."""


class LaneFullError(LaneHandoffError):
    """A request waiting for a slot on a full lane, handed to a lane with one free: rebalancing, not a fault."""


class ResumeMismatchError(APIError):
    """A resumed stream's regenerated text does not continue what the stream sent (the request was changed)."""

    status = HTTPStatus.CONFLICT
    code = ErrorCode.resume_mismatch
    retryable = False  # OpenAI's SDKs retry every 409; the same request would meet the same mismatch


class RequestFailedError(APIError):
    """This request alone failed while generating (the requests beside it go on)."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR
    type = ErrorType.server
    code = ErrorCode.internal_error


def error_body(
    message: str, type_: ErrorType, *, code: ErrorCode | None = None, param: str | None = None
) -> ErrorResponse:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code))
