"""The one exception type for bad input to the engine.

The worker maps it to gRPC INVALID_ARGUMENT; its message says what is wrong.
"""


class InvalidRequestError(ValueError):
    pass
