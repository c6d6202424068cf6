"""Ingress: FastAPI behind Serve. Auth, body limits, and each request routed by its `model` to that model's front
(serve_app/model_front.py), which validates it and speaks the API; no model logic."""
from __future__ import annotations

import asyncio
import functools
import importlib.metadata

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.adapter_affinity import AdapterRoutes
from serve_app.body_limit import BodyLimit
from serve_app.config import AppArgs
from serve_app.errors import OpenAIError, install_error_handlers
from engine.step_stats import freeze_gc_heap
from serve_app.model_front import ModelFront
from serve_app.openai_protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from serve_app.replica_client import RemoteReplica, ReplicaClient
from serve_app.embeddings_api import EmbeddingRequest
from serve_app.generative_scoring_api import GenerativeScoringRequest
from serve_app.messages_api import CountTokensRequest, MessagesRequest
from serve_app.score_api import RerankRequest, ScoreRequest
from serve_app.responses import CompletionResponse
from serve_app.responses_api import ResponsesRequest
from serve_app.security import Guard, exposure_problem


def _proxy_host() -> str | None:
    try:
        return serve.context._get_global_client().http_config.host
    except Exception:  # no reachable controller: exposure_problem treats the address as unknown
        return None


def refuse_exposure(args: AppArgs) -> None:
    problem = exposure_problem(_proxy_host(), args.api_key, args.allow_unauthenticated)
    if problem:
        raise RuntimeError(problem)  # the deployment fails to start, and `serve run` shows why


class Ingress:
    def __init__(self, replica: DeploymentHandle | ReplicaClient, args: AppArgs,
                 more_replicas: list[DeploymentHandle] | tuple = ()):
        """`replica` serves the app's first model, `more_replicas[k]` its `models[k]`."""
        refuse_exposure(args)
        self.args = args
        self.fronts = [ModelFront(_client(r, model), model)
                       for r, model in zip([replica, *more_replicas], args.served_models, strict=True)]
        freeze_gc_heap()

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this in each replica after __init__, so routes and middleware see this replica's args."""
        return build_api(self)

    async def health(self) -> dict:
        """Ready when every model has a ready, healthy engine replica."""
        results = await asyncio.gather(*(front.stats() for front in self.fronts), return_exceptions=True)
        for front, stats in zip(self.fronts, results):
            which = f" for model '{front.args.model_name}'" if len(self.fronts) > 1 else ""
            if isinstance(stats, BaseException):
                raise OpenAIError(503, f"no ready engine replica{which} ({type(stats).__name__})",
                                  retry_after_s=self.args.retry_after_s)
            if stats.health_problem:
                raise OpenAIError(503, f"the engine{which} is unhealthy", retry_after_s=self.args.retry_after_s)
        health = {"status": "ok", "num_running": sum(stats.engine.num_running for stats in results),
                  "num_waiting": sum(stats.engine.num_waiting for stats in results)}
        if len(self.fronts) > 1:  # and each model's, from one of its replicas (as the totals are)
            health["models"] = {front.args.model_name: {"num_running": stats.engine.num_running,
                                                        "num_waiting": stats.engine.num_waiting}
                                for front, stats in zip(self.fronts, results)}
        return health

    async def models(self) -> dict:
        """Every model's listing (ModelFront.cards), the app's first model first."""
        return {"object": "list", "data": [card for front in self.fronts for card in await front.cards()]}

    async def model(self, model_id: str) -> dict:
        """OpenAI's model object for a model or an adapter served (`GET /v1/models/{model}`); 404 for any other id."""
        return await self.front(model_id).card(model_id)

    def front(self, model_id: str | None) -> ModelFront:
        """The front of the model a request's `model` names (a model's name or one of its LoRA adapters); with
        one model, a request may leave it out; with several, as in Ray Serve LLM, it must name one."""
        if model_id is None:
            if len(self.fronts) > 1:
                raise OpenAIError(400, f"model: this server serves several models ({self._served()}); name one",
                                  "model")
            return self.fronts[0]
        for front in self.fronts:
            if front.serves(model_id):
                return front
        raise OpenAIError(404, f"model '{model_id[:256]}' does not exist; this server serves {self._served()}",
                          "model", "model_not_found")

    def _served(self) -> str:
        names = " or ".join(repr(name) for front in self.fronts for name in front.args.model_names)
        adapters = [name for front in self.fronts for name in front.adapters]
        return names + (f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else "")

def _client(replica: DeploymentHandle | ReplicaClient, model: AppArgs) -> ReplicaClient:
    if not isinstance(replica, DeploymentHandle):
        return replica
    if not model.adapter_affinity:
        return RemoteReplica(replica)
    return RemoteReplica(replica, AdapterRoutes(frozenset(model.engine_config.lora_module_names)))


@functools.cache  # a scan of the installed distributions' metadata: once a process
def server_version() -> str:
    try:
        return importlib.metadata.version("llm-serve")
    except importlib.metadata.PackageNotFoundError:  # a copied tree run from its folder, not installed (a GPU check)
        return "unknown"


def build_api(ingress: Ingress) -> FastAPI:
    args = ingress.args
    api = FastAPI(title="llm-serve", version=server_version(), docs_url=None, redoc_url=None,
                  openapi_url=args.openapi_url)
    install_error_handlers(api)
    api.add_middleware(BodyLimit, max_bytes=args.max_body_bytes, timeout_s=args.body_timeout_s)
    api.add_middleware(Guard, api_key=args.api_key)  # added last, so outermost: a refused key never reads the body

    @api.get("/health")
    async def health():
        return await ingress.health()

    @api.get("/version")  # vLLM's; behind the key, as every route but /health
    async def version():
        return {"version": server_version()}

    @api.get("/v1/models")
    async def models():
        return await ingress.models()

    @api.get("/v1/models/{model:path}")  # a path: Hugging Face ids have a slash
    async def model(model: str):
        return await ingress.model(model)

    @api.post("/tokenize")  # vLLM's, at its paths
    async def tokenize(body: TokenizeRequest):
        return await ingress.front(body.model).tokenize(body)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await ingress.front(body.model).detokenize(body)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await ingress.front(body.model).respond(body, body.prompt, chat=False, request=request)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [m.for_template() for m in body.messages]
        return await ingress.front(body.model).respond(body, messages, chat=True, request=request)

    @api.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return CompletionResponse(await ingress.front(body.model).embed(body, request))

    @api.post("/score")
    @api.post("/v1/score")
    async def score(body: ScoreRequest, request: Request):
        return CompletionResponse(await ingress.front(body.model).score(body, request))

    @api.post("/rerank")
    @api.post("/v1/rerank")
    @api.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request):
        return CompletionResponse(await ingress.front(body.model).rerank(body, request))

    @api.post("/generative_scoring")  # vLLM's path
    async def generative_scoring(body: GenerativeScoringRequest, request: Request):
        return CompletionResponse(await ingress.front(body.model).generative_scoring(body, request))

    @api.post("/v1/messages")  # Anthropic's, as vLLM serves it; errors in Anthropic's envelope (errors.py)
    async def messages(body: MessagesRequest, request: Request):
        return await ingress.front(body.model).respond_to_messages(body, request)

    @api.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest):
        return await ingress.front(body.model).count_message_tokens(body)

    @api.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await ingress.front(body.model).respond_to_responses(body, request)

    return api


IngressDeployment = serve.ingress()(Ingress)
