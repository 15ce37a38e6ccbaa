"""vLLM as a server (`grpo.vllm_mode: server`): `shardlm vllm-serve` runs one engine in a process of its own (its
own GPUs, or vLLM's CPU build), and the trainer's ranks reach it over HTTP as TRL's `trl vllm-serve` does.

The trainer's rank 0 tells the server the model's config (`/init`: the engine starts with dummy weights, as the
colocated one does) and pushes the policy's weights after every `grpo.weight_sync_steps` optimizer steps: broadcast
over a gloo group of two (rank 0 and the server, apart from the trainer's own process group; the names, shapes
and dtypes by `/weights_group`), or with `grpo.vllm_weight_transfer=http` as safetensors chunks (`/weights`, never
pickles); `/weights/done` reloads them in place and resets the prefix cache. Every rank sends its own prompts to
`/generate` and gets token ids and processed log-probabilities back, each completion seeded by its key, so 2 ranks
sample what 1 process samples. The group is gloo, so on GPUs the weights pass through host memory; NCCL between
the trainer and the engine (TRL's communicator) is not built yet.
"""

from __future__ import annotations

import datetime
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as tdist

from shardlm import ShardlmError
from shardlm.objectives.rl.engine import (
    adapter_rank,
    adapter_tensors,
    engine_config,
    generate,
    policy_weights,
    reload,
    start_engine,
)
from shardlm.objectives.rl.sampling import Rollout, SamplingParams

CHUNK = 64 << 20  # bytes of weights per /weights request


# ---- the server ------------------------------------------------------------------------------------------------
class Engine:
    """The server's state: one engine, rebuilt when a trainer asks for another model; one request at a time."""

    def __init__(self, on_gpu: bool, gpu_memory_utilization: float):
        self.on_gpu, self.memory = on_gpu, gpu_memory_utilization
        self.llm: Any = None
        self.spec: dict | None = None
        self.folder = ""
        self.vocab: int | None = None
        self.lora: Any = None  # the policy's adapters as the engine's one LoRA, when the trainer sends them alone
        self.adapter_config: dict | None = None
        self.pending: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()
        self.group: Any = None  # the weight group with the trainer's rank 0 (grpo.vllm_weight_transfer=group)
        self.joining = threading.Thread()

    def init(self, body: dict) -> dict:
        from transformers import AutoConfig

        spec = {k: body.get(k) for k in ("config", "precision", "max_model_len", "seed", "rows", "lora_rank")}
        if spec != self.spec:
            config = AutoConfig.for_model(**body["config"])
            if self.llm is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.llm, self.spec = None, None  # a failed start below leaves no engine to reuse
            self.llm, self.folder = start_engine(config, body["precision"], body["max_model_len"], body["seed"],
                                                 self.on_gpu, body["rows"], self.memory,
                                                 lora_rank=body.get("lora_rank"))
            self.spec = spec
        self.vocab, self.adapter_config, self.lora = body.get("vocab"), body.get("adapter_config"), None
        return {"ok": True}

    def adapters(self, payload: bytes) -> dict:
        """The policy's LoRA adapters (safetensors bytes, PEFT's names), loaded in place as the engine's LoRA."""
        import os

        from vllm.lora.request import LoRARequest

        folder = os.path.join(self.folder, "policy")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(self.adapter_config, f)
        with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
            f.write(payload)
        self.lora = LoRARequest("policy", 1, folder, load_inplace=True)
        return {"ok": True}

    def generate(self, body: dict) -> dict:
        params = SamplingParams(**{**body["params"], "stop": tuple(body["params"]["stop"])})
        out = generate(self.llm, body["prompts"], body["keys"], params, self.vocab, self.lora)
        return {"completions": out.completions, "logps": out.logps}

    def weights(self, payload: bytes) -> dict:
        from safetensors.torch import load

        self.pending.update(load(payload))
        return {"ok": True}

    def init_group(self, body: dict, trainer_host: str) -> dict:
        """Join the trainer's weight group (gloo; the trainer's rank 0 holds its store) on a thread of its own:
        the trainer joins after this request returns."""
        def join() -> None:
            self.group = weight_group(group_store(trainer_host, body["port"], body["timeout"], False), 1,
                                      body["timeout"])

        self.group, self.joining = None, threading.Thread(target=join, daemon=True)
        self.joining.start()
        return {"ok": True}

    def weights_group(self, body: dict) -> dict:
        """A chunk of weights broadcast by the trainer, tensor by tensor in the order `body` lists them."""
        self.joining.join()
        if self.group is None:
            raise RuntimeError("the weight group with the trainer did not form")
        for name, shape, dtype in body["tensors"]:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            broadcast(self.group, tensor)
            self.pending[name] = tensor
        return {"ok": True}

    def weights_done(self) -> dict:
        reload(self.llm, iter(list(self.pending.items())))
        self.pending.clear()
        return {"ok": True}


def serve(host: str, port: int, on_gpu: bool, gpu_memory_utilization: float = 0.9) -> None:
    """Answer trainers until interrupted."""
    engine = Engine(on_gpu, gpu_memory_utilization)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # one line per request would drown the engine's own log
            pass

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

        def do_POST(self) -> None:
            payload = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                with engine.lock:
                    if self.path == "/weights":
                        body = engine.weights(payload)
                    elif self.path == "/weights/done":
                        body = engine.weights_done()
                    elif self.path == "/adapters":
                        body = engine.adapters(payload)
                    elif self.path == "/init_group":
                        body = engine.init_group(json.loads(payload), self.client_address[0])
                    elif self.path == "/weights_group":
                        body = engine.weights_group(json.loads(payload))
                    elif self.path in ("/init", "/generate"):
                        request = json.loads(payload)
                        body = engine.init(request) if self.path == "/init" else engine.generate(request)
                    else:
                        return self._reply(404, {"error": f"no endpoint {self.path}"})
            except Exception as e:  # the trainer shows the server's error as its own
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            self._reply(200, body)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        raise ShardlmError(f"shardlm vllm-serve cannot listen on {host}:{port} ({e.strerror}): another server may "
                           "hold it; choose another --port (and grpo.vllm_server_port alike).") from None
    print(f"shardlm vllm-serve: listening on http://{host}:{port} (POST /init, /generate, /weights)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def group_store(host: str, port: int, timeout: float, holder: bool) -> Any:
    """The weight group's store: held by the trainer's rank 0 (`holder`, listening on all addresses), reached by
    the server at the address the trainer's requests come from."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, 2, holder, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)


def weight_group(store: Any, rank: int, timeout: float) -> Any:
    """A two-member gloo group, the trainer's rank 0 (rank 0) and the server (rank 1), apart from the trainer's
    own process group: what the weights are broadcast over. Each side blocks here until the other joins."""
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout)), store


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group[0].broadcast([tensor], options).wait()


# ---- the trainer's side ----------------------------------------------------------------------------------------
def server_url(g: Any) -> str:
    host = "127.0.0.1" if g.vllm_server_host in ("0.0.0.0", "") else g.vllm_server_host
    return f"http://{host}:{g.vllm_server_port}"


def wait_for_server(g: Any) -> None:
    """The server's /health, polled until it answers or grpo.vllm_server_timeout passes: one line then (the run,
    before its model loads, and the dry run)."""
    deadline, url = time.time() + g.vllm_server_timeout, server_url(g)
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        print(f"waiting up to {g.vllm_server_timeout:g} s for the vLLM server at {url} (grpo.vllm_server_timeout)",
              flush=True)
    while True:
        try:
            with urllib.request.urlopen(server_url(g) + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.time() > deadline:
            raise ShardlmError(f"no vLLM server answered at {url.removeprefix('http://')} within "
                               f"grpo.vllm_server_timeout={g.vllm_server_timeout:g} s: start one with `shardlm "
                               f"vllm-serve --port {g.vllm_server_port}` (in vLLM's environment), or set "
                               "grpo.vllm_server_host / vllm_server_port to where it listens.")
        time.sleep(1.0)


class ServerSampler:
    """`Sampler` on a `shardlm vllm-serve` engine; every rank holds one, rank 0 alone pushes the weights."""

    def __init__(self, model: Any, g: Any, max_model_len: int, precision: str, seed: int, dist: Any,
                 vocab: int | None = None, rows: int = 64):
        self.model, self.dist, self.syncs = model, dist, 0
        self.url, self.timeout = server_url(g), g.vllm_server_timeout
        self.transfer, self.group_port = g.vllm_weight_transfer, g.vllm_group_port
        self.group: Any = None  # (gloo group, its store) with the server, formed at the first sync
        self.sender: Any = None
        wait_for_server(g)
        config = engine_config(model)
        self.lora_rank = adapter_rank(model) if g.vllm_lora_adapters else None
        if dist.is_main:
            adapter_config = None
            if self.lora_rank is not None:
                from shardlm.models.lora import ADAPTER

                adapter_config = json.loads(json.dumps(model.hf.peft_config[ADAPTER].to_dict(), default=list))
            self._post("/init", {"config": config.to_dict(), "precision": precision, "max_model_len": max_model_len,
                                 "seed": seed, "rows": rows * dist.world_size, "lora_rank": self.lora_rank,
                                 "adapter_config": adapter_config,
                                 "vocab": vocab if vocab is not None and vocab < config.vocab_size else None})
        self._barrier()

    def _post(self, path: str, body: dict | None = None, payload: bytes | None = None) -> dict:
        data = payload if payload is not None else json.dumps(body).encode()
        kind = "application/octet-stream" if payload is not None else "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": kind})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = json.loads(e.read() or b"{}").get("error", str(e))
            raise ShardlmError(f"the vLLM server at {self.url} refused {path}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ShardlmError(f"the vLLM server at {self.url} stopped answering ({path}: {e}): restart `shardlm "
                               "vllm-serve`, then `shardlm resume` the run.") from None

    def _barrier(self) -> None:
        if self.dist.distributed:
            torch.distributed.barrier()

    def sync(self) -> None:
        """Every rank gathers (collective); rank 0 sends the weights in chunks; the others wait for the reload.
        With LoRA adapters the base goes once, then the adapters alone."""
        from safetensors.torch import save

        if self.lora_rank is None or self.syncs == 0:
            self._send_weights(base=self.lora_rank is not None)
        if self.lora_rank is not None:
            tensors = adapter_tensors(self.model)
            if self.dist.is_main:
                self._post("/adapters", payload=save(tensors))
        self._barrier()
        self.syncs += 1

    def _send_weights(self, base: bool) -> None:
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in policy_weights(self.model, base=base):
            if not self.dist.is_main:
                continue
            chunk[name] = tensor.detach().to("cpu").clone()  # safetensors refuses tensors sharing storage
            size += tensor.numel() * tensor.element_size()
            if size >= CHUNK:
                self._send_chunk(chunk)
                chunk, size = {}, 0
        if self.dist.is_main:
            if chunk:
                self._send_chunk(chunk)
            self._post("/weights/done", {})

    def _send_chunk(self, chunk: dict[str, torch.Tensor]) -> None:
        """Over HTTP as safetensors bytes, or broadcast over the weight group while the server's request for it
        waits (the names, shapes and dtypes go by HTTP)."""
        from safetensors.torch import save

        if self.transfer == "http":
            self._post("/weights", payload=save(chunk))
            return
        if self.group is None:  # formed at the first sync: the server joins while this rank holds the store
            from concurrent.futures import ThreadPoolExecutor

            try:
                store = group_store("0.0.0.0", self.group_port, self.timeout, True)
            except (RuntimeError, OSError) as e:  # DistNetworkError: the port is taken
                raise ShardlmError(f"grpo.vllm_group_port={self.group_port} could not be opened for the weight group "
                                   f"({str(e).splitlines()[0]}): another run may hold it; set another "
                                   "grpo.vllm_group_port, or grpo.vllm_weight_transfer=http.") from None
            self._post("/init_group", {"port": self.group_port, "timeout": self.timeout})
            self.group = weight_group(store, 0, self.timeout)
            self.sender = ThreadPoolExecutor(1, thread_name_prefix="shardlm-weights")
        meta = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in chunk.items()]
        reply = self.sender.submit(self._post, "/weights_group", {"tensors": meta})
        try:
            for tensor in chunk.values():
                broadcast(self.group, tensor)
        except RuntimeError as e:  # gloo's own words for a peer that went away
            raise ShardlmError(f"the vLLM server at {self.url} stopped answering during a weight sync "
                               f"({str(e).splitlines()[0]}): restart `shardlm vllm-serve`, then `shardlm resume` "
                               "the run.") from None
        reply.result()

    def sample(self, prompts: Sequence[Sequence[int]], keys: Sequence[int], params: SamplingParams) -> Rollout:
        got = self._post("/generate", {"prompts": [list(p) for p in prompts], "keys": list(keys),
                                       "params": {**params.__dict__, "stop": list(params.stop)}})
        out = Rollout([list(p) for p in prompts], got["completions"], [], params.group, got["logps"])
        stop = set(params.stop)
        out.truncated = [not c or c[-1] not in stop for c in out.completions]
        return out
