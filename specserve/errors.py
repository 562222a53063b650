"""Exceptions the library raises for bad input; each message names the problem."""


class SpecServeError(Exception):
    """Base class of every error specserve raises on purpose."""


class ModelSourceError(SpecServeError):
    """A model could not be found, fetched, verified or converted."""


class UnknownModelError(ModelSourceError):
    pass


class CorruptModelError(ModelSourceError):
    pass


class HubUnreachableError(ModelSourceError):
    pass


class UnsupportedModelError(SpecServeError):
    """The checkpoint's architecture or options are outside the Llama family this runner implements."""


class KVCapacityError(SpecServeError):
    """A sequence would exceed its KV slot, or no slot is free."""


class InvalidRequestError(SpecServeError, ValueError):
    """A request's prompt or sampling values are invalid."""
