"""The errors that cross layers: what a caller may catch without importing the layer that
raised it."""


class InvalidRequest(ValueError):
    """User input that cannot be served; the message is shown to the client as is (HTTP 400)."""


class QueueFull(RuntimeError):
    """The waiting queue is at --max-queued-requests (HTTP 503)."""


class EngineFailed(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot run any more."""


class IntegrityError(RuntimeError):
    """The KV bookkeeping broke an invariant: a page or a slot is lost or shared."""
