"""Ray itself asks for the cluster's token (issue 41 item 3): the GCS, and each Serve replica's gRPC server, which
Ray 2.60 binds to every interface, refuse a caller without it. Run against a cluster without token auth
(RAY_AUTH_MODE=disabled), the first test fails: the GCS answers anyone."""
import grpc
import psutil
import pytest
import ray
from ray._private.authentication.grpc_authentication_client_interceptor import _get_authentication_metadata_tuple
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
from ray.serve.generated import serve_pb2, serve_pb2_grpc


def call(address: str, method, request, metadata=()):
    """The status code a unary call gets (OK when it answers)."""
    with grpc.insecure_channel(address) as channel:
        try:
            method(channel)(request, timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()


def gcs_cluster_id(channel):
    return gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId


def replica_request(channel):
    return serve_pb2_grpc.ASGIServiceStub(channel).HandleRequest


def test_the_gcs_refuses_a_caller_without_the_clusters_token(serve_app):
    gcs = ray.get_runtime_context().gcs_address
    request = gcs_service_pb2.GetClusterIdRequest()
    assert call(gcs, gcs_cluster_id, request) == grpc.StatusCode.UNAUTHENTICATED
    assert call(gcs, gcs_cluster_id, request, [("authorization", "Bearer not-the-token")]) == grpc.StatusCode.UNAUTHENTICATED
    assert call(gcs, gcs_cluster_id, request, _get_authentication_metadata_tuple()) == grpc.StatusCode.OK


def replica_ports() -> list[int]:
    """The ports every Serve replica of the app listens on, however they are bound."""
    ports = []
    for process in psutil.process_iter(["cmdline"]):
        if "ServeReplica:llm" in " ".join(process.info["cmdline"] or []):
            ports += [c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    return ports


def test_every_serve_replicas_grpc_server_refuses_a_caller_without_the_token(serve_app):
    ports = replica_ports()
    assert ports, "no replica process found"
    codes = {port: call(f"127.0.0.1:{port}", replica_request, serve_pb2.ASGIRequest()) for port in ports}
    # each replica has its inter-deployment server (the one that unpickles requests) and Ray's core worker port,
    # which answers UNIMPLEMENTED for a Serve method before it reads any payload
    assert grpc.StatusCode.OK not in codes.values()
    assert list(codes.values()).count(grpc.StatusCode.UNAUTHENTICATED) >= 2, codes  # the ingress and the engine replica
