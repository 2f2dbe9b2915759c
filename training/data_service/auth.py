"""The job's token on every call between hosts: one header on the client side, one check on the server side.

The launch side writes a random token per job into a file of the job's ``platform`` channel (never the
hyperparameters, which DescribeTrainingJob shows: training/hyperparameters.py). Every RPC
between hosts (a data host's Describe, StreamBatches and Shutdown; a DNN host's ReportFailure) carries it
as ``authorization: Bearer <token>`` call metadata, and the servers refuse any call without it with
UNAUTHENTICATED before a handler runs, and before its request is read (server.MAX_REQUEST_BYTES bounds
what gRPC takes in meanwhile): whoever reaches a data host's port can neither read the training
data, nor drain the trainers' batches, nor keep the host alive, nor stop it. The token is compared in
constant time and never logged.
"""

from __future__ import annotations

import hmac
import logging

import grpc

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What a client passes as ``metadata=`` on every call."""
    return ((AUTHORIZATION, f"Bearer {token}"),)


def presented_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    """The bearer token of a call's metadata, or '' when it has none. Pure."""
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return ""


class TokenAuth(grpc.ServerInterceptor):
    """Refuses every call whose token is not the job's."""

    def __init__(self, token: str) -> None:
        if len(token) < 16:  # an empty token would let every call through
            raise ValueError("a server needs the job's token (at least 16 characters) to check calls against")
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201 (grpc's interface)
        token = presented_token(handler_call_details.invocation_metadata)
        if hmac.compare_digest(token.encode(), self._token):
            return continuation(handler_call_details)
        method = handler_call_details.method
        log.warning("refused %s: %s", method, "no token" if not token else "a token that is not this job's")
        # A handler of a streaming request, whatever the method's kind: gRPC reads a unary request whole
        # before it calls the handler (grpc/_server.py, _unary_request), but the messages of a streaming
        # one only as the handler iterates over them, and this one never does. The caller gets the status
        # and no message, for a unary or a streaming method alike.
        return grpc.stream_unary_rpc_method_handler(_refuse_unread)


def _refuse_unread(requests: object, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call does not carry the job's token")
