"""Runtimes that execute the policy network: onnxruntime and torch, CPU or CUDA.

A backend builds :class:`LoadedPolicy` objects, one per weights version; the server
holds the one serving, the previous one (for rollback) and at most one staged::

    backend = make_backend(spec, config)         # config: InferenceConfig
    policy = backend.initial()                   # random (init_seed) or config.weights
    actions = policy.run(obs, eps)               # obs: {key: [B, ...]}, eps: f32[B, *action]
    newer = backend.from_state_dict(arrays, 7)   # numpy or torch tensors; validated; raises WeightsError
    newer = backend.from_onnx(blob, 8)

- **onnxruntime**: providers in the configured order, keeping those this build has
  (``onnxruntime-gpu`` brings TensorRT and CUDA; the plain wheel only CPU). On a GPU
  provider inputs and outputs go through IOBinding. A state dict replaces the base
  graph's initializers (``SessionOptions.add_initializer``) without re-serialising it.
- **torch**: eager on the CPU; on CUDA one CUDA graph per batch bucket
  (``batch_buckets``), captured when a version is loaded, with a batch padded up to the
  next bucket. It also runs observations that are already tensors on its device (CUDA IPC
  from a worker on the same GPU: :mod:`gateway.cuda_ipc`) and loads weights from device
  tensors without a trip through the host.

Both load a torch-made model to the same actions (tests hold them within 1e-5). Each
version is built on the loader thread while the serving one keeps running; nothing
here touches sockets.
"""

from __future__ import annotations

import abc
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gateway.episode import EnvSpec
from gateway.protocol import ErrorCode
from inference.config import InferenceConfig
from inference.graph_files import GraphFiles
from inference.weights import WeightsError, check_state_dict, host_arrays

log = logging.getLogger(__name__)

GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "ROCMExecutionProvider")
# A received frame is read-only; the network never writes into its inputs.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class LoadedPolicy(abc.ABC):
    """One weights version, ready to run."""

    version: int
    received: Mapping[str, np.ndarray] | None = None
    """The transfer's arrays this version was loaded from, if it came over the wire; the
    server recycles their memory once the version has retired."""

    @abc.abstractmethod
    def run(self, obs: dict[str, Any], eps: np.ndarray) -> np.ndarray:
        """Actions ``[B, *action_shape]`` (float32) for a batch of observations (numpy
        arrays, or tensors on the backend's :meth:`Backend.tensor_device`) and noise."""


class Backend(abc.ABC):
    """Builds :class:`LoadedPolicy` versions for one spec and config."""

    name: str = ""

    def __init__(self, spec: EnvSpec, config: InferenceConfig) -> None:
        self.spec, self.config = spec, config
        self.action_shape = tuple(spec.action.shape)

    @abc.abstractmethod
    def initial(self) -> LoadedPolicy:
        """The version the server starts with (``config.weights`` or random weights)."""

    @abc.abstractmethod
    def from_state_dict(
        self, arrays: dict[str, Any], version: int, *, finite_checked: bool = False
    ) -> LoadedPolicy:
        """A validated version from state-dict arrays, numpy or torch tensors on any device
        (``finite_checked``: NaN/Inf were ruled out already, as the transfer arrived); raises
        :class:`WeightsError`."""

    @abc.abstractmethod
    def from_onnx(self, blob: np.ndarray, version: int) -> LoadedPolicy:
        """A validated version from a serialised ONNX model; raises :class:`WeightsError`."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Backend, device and providers, for METADATA."""

    def prepare(self) -> None:  # noqa: B027 - a hook: most backends have nothing to prepare
        """Get ready for the next version while the loader is idle."""

    def tensor_device(self) -> str | None:
        """The device whose torch tensors :meth:`LoadedPolicy.run` takes as observations
        (CUDA IPC, :mod:`gateway.cuda_ipc`); None: numpy arrays only."""
        return None

    def concat(self, parts: list[Any]) -> Any:
        """One batch of a key's rows from several requests."""
        return np.concatenate(parts)

    def smoke_test(self, policy: LoadedPolicy) -> None:
        """Run a zero batch through ``policy``; refuse it unless the actions are finite and shaped right."""
        zeros = self.spec.zeros(2)
        eps = np.zeros((2, *self.action_shape), np.float32)
        try:
            out = policy.run(zeros, eps)
        except Exception as exc:  # any runtime failure means the model is unusable
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"the model fails to run: {exc}") from None
        if out.shape != (2, *self.action_shape) or not np.isfinite(out).all():
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS,
                f"the model gives {out.dtype}{list(out.shape)} actions that are not finite",
            )


def make_backend(spec: EnvSpec, config: InferenceConfig) -> Backend:
    if config.backend == "torch":
        return TorchBackend(spec, config)
    return OrtBackend(spec, config)


def _torch_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"inference.device is {device!r} but torch sees no CUDA device")
    return device


def load_weights_file(path: str) -> dict[str, np.ndarray] | bytes:
    """A ``.pt``/``.pth``/``.npz`` state dict as numpy arrays, or an ``.onnx`` file's bytes."""
    p = Path(path)
    if p.suffix == ".onnx":
        return p.read_bytes()
    if p.suffix == ".npz":
        with np.load(p) as data:
            return {k: data[k] for k in data.files}
    import torch

    state = torch.load(p, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "actor" in state and isinstance(state["actor"], dict):
        state = state["actor"]  # a trainer checkpoint holding several modules
    return {k: v.detach().cpu().contiguous().numpy() for k, v in state.items()}


# ------------------------------------------------------------------------- torch


class TorchPolicy(LoadedPolicy):
    def __init__(self, actor: Any, version: int, device: str, buckets: tuple[int, ...], graphs: bool) -> None:
        import torch

        self.torch = torch
        self.actor, self.version, self.device = actor, version, device
        self.keys = tuple(actor.spec.observation)
        self.graphs: dict[int, tuple[Any, dict[str, Any], Any, Any]] = {}
        if graphs and device.startswith("cuda"):
            self._capture(buckets)

    def _capture(self, buckets: tuple[int, ...]) -> None:
        """One CUDA graph per bucket, with static input and output buffers."""
        torch = self.torch
        spec = self.actor.spec
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in buckets:
            obs = {
                k: torch.zeros((size, *a.shape), dtype=getattr(torch, a.dtype), device=self.device)
                for k, a in spec.observation.items()
            }
            eps = torch.zeros((size, *self.actor.action_shape), device=self.device)
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm up kernels and allocator outside the capture
                    self.actor(obs, eps)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the serving thread keeps running its own kernels meanwhile.
            with (
                torch.inference_mode(),
                torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
            ):
                out = self.actor(obs, eps)
            self.graphs[size] = (graph, obs, eps, out)
        torch.cuda.synchronize(self.device)

    def _input(self, value: Any) -> Any:
        """A tensor of ``value``: numpy arrays are wrapped (host), tensors taken as they are."""
        return self.torch.from_numpy(value) if isinstance(value, np.ndarray) else value

    def run(self, obs: dict[str, Any], eps: np.ndarray) -> np.ndarray:
        torch = self.torch
        n = len(eps)
        if self.graphs:
            fits = [b for b in self.graphs if b >= n]
            if fits:
                graph, static_obs, static_eps, out = self.graphs[min(fits)]
                for k in self.keys:
                    static_obs[k][:n].copy_(self._input(obs[k]), non_blocking=False)
                static_eps[:n].copy_(torch.from_numpy(eps))
                graph.replay()
                return np.asarray(out[:n].cpu().numpy())
            top = max(self.graphs)  # larger than every bucket: run it in bucket-sized pieces
            return np.concatenate(
                [
                    self.run({k: v[i : i + top] for k, v in obs.items()}, eps[i : i + top])
                    for i in range(0, n, top)
                ]
            )
        with torch.inference_mode():
            tensors = {k: self._input(obs[k]).to(self.device) for k in self.keys}
            return np.asarray(self.actor(tensors, torch.from_numpy(eps).to(self.device)).cpu().numpy())


def _same_device(a: Any, b: Any) -> bool:
    """Whether two torch devices are one (``cuda`` is ``cuda:0`` on device 0)."""
    return bool(a.type == b.type and (a.index is None or b.index is None or a.index == b.index))


def _writable(arr: np.ndarray) -> np.ndarray:
    """torch shares memory only with writable arrays; received frames usually are."""
    arr = np.asarray(arr)
    return arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr)


def _owner(module: Any, name: str) -> tuple[Any, str]:
    """The submodule that holds the dotted state-dict ``name``, and the name there."""
    prefix, _, attr = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), attr


def _assign_state(actor: Any, tensors: dict[str, Any]) -> None:
    """Make ``tensors`` the actor's parameters (and persistent buffers), by name, without
    copying them.

    What ``load_state_dict(tensors, assign=True)`` does, without its walk of every module
    and its hooks (0.3 ms of a 1M-parameter swap); the networks here define no load hooks.
    The names, dtypes and shapes were checked against the network (:func:`check_state_dict`).
    """
    from torch import nn

    for name, tensor in tensors.items():
        owner, attr = _owner(actor, name)
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
        elif attr in owner._buffers and attr not in owner._non_persistent_buffers_set:
            owner._buffers[attr] = tensor
        else:
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"{name!r} is not in the network's state dict")


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, spec: EnvSpec, config: InferenceConfig) -> None:
        super().__init__(spec, config)
        import torch

        from networks.modules import make_actor

        self.torch, self._make_actor = torch, make_actor
        self.device = _torch_device(config.device)
        if config.threads and self.device == "cpu":
            torch.set_num_threads(config.threads)
        self.template = make_actor(spec, config.network)
        self.expected = {
            k: (str(v.dtype).replace("torch.", ""), tuple(v.shape))
            for k, v in self.template.state_dict().items()
        }
        self._skeleton: Any = None
        """A parameterless actor built ahead of the next version (:meth:`prepare`)."""
        # The first network built on the meta device may import torch's compiler stack (a
        # CNN encoder sizes itself with a forward pass there; about a second): pay it at
        # start-up, not in the first weight swap.
        self.prepare()

    def _meta_actor(self) -> Any:
        """An actor on the meta device: structure only, no parameter memory."""
        self.prepare()
        actor, self._skeleton = self._skeleton, None
        return actor

    def prepare(self) -> None:
        # Building the module structure costs about a millisecond of Python, as much as
        # the rest of a small network's swap: do it before the next version arrives, with
        # its action bounds on the device and in eval mode (another 0.3 ms of module walks).
        if self._skeleton is None:
            with self.torch.device("meta"):
                skeleton = self._make_actor(self.spec, self.config.network)
            for name, buf in self.template.named_buffers():
                owner, attr = _owner(skeleton, name)
                owner.register_buffer(attr, buf.to(self.device, copy=True), persistent=False)
            self._skeleton = skeleton.eval()

    def _empty_actor(self) -> Any:
        """An actor with uninitialised parameters on the device (a random initialisation
        of a large network costs far more than loading the published weights)."""
        actor = self._meta_actor().to_empty(device=self.device)
        for name, buf in self.template.named_buffers():  # the action bounds
            actor.get_buffer(name).copy_(buf)
        return actor

    def _build(self, arrays: dict[str, Any], version: int) -> TorchPolicy:
        torch = self.torch
        tensors = {
            k: v if isinstance(v, torch.Tensor) else torch.from_numpy(_writable(v)) for k, v in arrays.items()
        }
        here = torch.device(self.device)
        on_device = all(_same_device(t.device, here) for t in tensors.values())
        if on_device:
            # The received arrays (or the device copies of a CUDA IPC publication, which
            # nobody else holds) become the parameters themselves: no copy of the weights.
            actor = self._meta_actor()
            _assign_state(actor, tensors)
        else:
            actor = self._empty_actor()
            actor.load_state_dict(tensors, strict=True)
        c = self.config
        policy = TorchPolicy(actor, version, self.device, c.batch_buckets, c.cuda_graphs)
        self.smoke_test(policy)
        return policy

    def initial(self) -> LoadedPolicy:
        c = self.config
        if c.weights is None:
            actor = self._make_actor(self.spec, c.network, seed=c.init_seed)
            arrays = {k: v.numpy() for k, v in actor.state_dict().items()}
            return self._build(arrays, c.initial_version)
        loaded = load_weights_file(c.weights)
        blob = np.frombuffer(loaded, np.uint8) if isinstance(loaded, bytes) else None
        if blob is not None:
            return self.from_onnx(blob, c.initial_version)
        assert not isinstance(loaded, bytes)
        return self.from_state_dict(loaded, c.initial_version)

    def from_state_dict(
        self, arrays: dict[str, Any], version: int, *, finite_checked: bool = False
    ) -> LoadedPolicy:
        check_state_dict(arrays, self.expected, check_finite=not finite_checked)
        return self._build(arrays, version)

    def tensor_device(self) -> str | None:
        return self.device

    def concat(self, parts: list[Any]) -> Any:
        if all(isinstance(p, np.ndarray) for p in parts):
            return np.concatenate(parts)
        torch = self.torch
        return torch.cat(
            [torch.from_numpy(p).to(self.device) if isinstance(p, np.ndarray) else p for p in parts]
        )

    def from_onnx(self, blob: np.ndarray, version: int) -> LoadedPolicy:
        """An ONNX model made by ``export_onnx``: its initializers are the state dict."""
        from onnx import numpy_helper

        model = parse_onnx(blob)
        arrays = {
            i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in self.expected
        }
        return self.from_state_dict(arrays, version)

    def describe(self) -> dict[str, Any]:
        torch = self.torch
        info: dict[str, Any] = {
            "backend": "torch",
            "device": self.device,
            "providers": [],
            "torch": torch.__version__,
        }
        if self.device.startswith("cuda"):
            info["cuda_graphs"] = self.config.cuda_graphs
            info["gpu"] = torch.cuda.get_device_name(torch.device(self.device))
        return info


# ------------------------------------------------------------------- onnxruntime


def parse_onnx(blob: np.ndarray | bytes) -> Any:
    """Parse a serialised ONNX model; a truncated or garbled blob is ``bad_weights``."""
    import onnx
    from google.protobuf.message import DecodeError

    data = blob.tobytes() if isinstance(blob, np.ndarray) else bytes(blob)
    try:
        model = onnx.load_from_string(data)
        onnx.checker.check_model(model)
    except (DecodeError, onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        raise WeightsError(
            ErrorCode.BAD_WEIGHTS, f"not a valid ONNX model ({len(data)} bytes): {exc}"
        ) from None
    if not model.graph.node:
        raise WeightsError(ErrorCode.BAD_WEIGHTS, f"the ONNX model ({len(data)} bytes) has no graph")
    return model


class OrtPolicy(LoadedPolicy):
    def __init__(self, session: Any, version: int, device_id: int | None, keep: Any = None) -> None:
        self.session, self.version, self.device_id = session, version, device_id
        self._keep = keep  # OrtValues that back overridden initializers must outlive the session
        self.inputs = [i.name for i in session.get_inputs()]

    def run(self, obs: dict[str, np.ndarray], eps: np.ndarray) -> np.ndarray:
        feeds = {name: (eps if name == "eps" else obs[name[4:]]) for name in self.inputs}
        if self.device_id is None:
            return np.asarray(self.session.run(["action"], feeds)[0])
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        binding.bind_output("action", "cuda", self.device_id)
        self.session.run_with_iobinding(binding)
        return np.asarray(binding.copy_outputs_to_cpu()[0])


class OrtBackend(Backend):
    name = "onnxruntime"

    def __init__(self, spec: EnvSpec, config: InferenceConfig) -> None:
        super().__init__(spec, config)
        import onnxruntime as ort

        self.ort = ort
        available = ort.get_available_providers()
        wanted = [p for p in config.providers if p in available]
        if config.device == "cpu":
            wanted = []
        self.device_id = int(config.device.partition(":")[2] or 0)
        if config.device.startswith("cuda") and not any(p in GPU_PROVIDERS for p in wanted):
            raise ValueError(
                f"inference.device is {config.device!r} but onnxruntime has no GPU provider ({available})"
            )
        if "CPUExecutionProvider" not in wanted:
            wanted.append("CPUExecutionProvider")
        self.providers = wanted
        # Sessions are created from files: from bytes onnxruntime holds the interpreter
        # lock while it parses (tens of ms for a 10 M model, stalling the serving
        # threads); from a path it does not. The graph file is written once per graph.
        self.files = GraphFiles()
        self.base = ""
        self.expected: dict[str, tuple[str, tuple[int, ...]]] = {}

    def _rebase(self, path: str, initializers: dict[str, np.ndarray]) -> None:
        """Later state dicts load into the graph at ``path`` (by initializer name)."""
        if self.base and self.base != path:
            self.files.remove(self.base)
        self.base = path
        self.expected = {k: (v.dtype.name, tuple(v.shape)) for k, v in initializers.items()}

    def _provider_list(self) -> list[Any]:
        out: list[Any] = []
        for p in self.providers:
            if p in ("CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider"):
                out.append((p, {"device_id": self.device_id}))
            else:
                out.append(p)
        return out

    def _session(self, path: str, overrides: dict[str, np.ndarray] | None, version: int) -> OrtPolicy:
        ort = self.ort
        options = ort.SessionOptions()
        if self.config.threads:
            options.intra_op_num_threads = self.config.threads
        options.inter_op_num_threads = 1
        keep = None
        if overrides:
            keep = {
                k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in overrides.items()
            }
            for name, value in keep.items():
                options.add_initializer(name, value)
        try:
            session = ort.InferenceSession(path, options, providers=self._provider_list())
        except Exception as exc:  # onnxruntime raises its own untyped errors for bad graphs
            raise WeightsError(ErrorCode.BAD_WEIGHTS, f"onnxruntime cannot load the model: {exc}") from None
        on_gpu = session.get_providers()[0] in GPU_PROVIDERS
        policy = OrtPolicy(session, version, self.device_id if on_gpu else None, (keep, overrides))
        self._check_signature(session)
        self.smoke_test(policy)
        return policy

    def _check_signature(self, session: Any) -> None:
        types = {"float32": "tensor(float)", "uint8": "tensor(uint8)", "float64": "tensor(double)"}
        want = {f"obs/{k}": (a.dtype, a.shape) for k, a in self.spec.observation.items()}
        want["eps"] = ("float32", self.action_shape)
        got = {i.name: i for i in session.get_inputs()}
        problems = []
        for name, (dtype, shape) in want.items():
            node = got.get(name)
            if node is None:
                problems.append(f"input {name!r} is missing")
            elif node.type != types.get(dtype, f"tensor({dtype})") or [
                d if isinstance(d, int) else -1 for d in node.shape[1:]
            ] != list(shape):
                problems.append(
                    f"input {name!r} is {node.type}{node.shape}, the spec needs {dtype}[batch, *{list(shape)}]"
                )
        problems += [f"unexpected input {n!r}" for n in got if n not in want]
        if [o.name for o in session.get_outputs()] != ["action"]:
            problems.append("the model must have one output named 'action'")
        if problems:
            raise WeightsError(
                ErrorCode.BAD_WEIGHTS, "the ONNX model does not fit the spec: " + "; ".join(problems)
            )

    def _adopt_base(self, blob: bytes) -> OrtPolicy:
        """Use ``blob`` as the graph later state dicts are loaded into."""
        from onnx import numpy_helper

        model = parse_onnx(blob)
        initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        for name, arr in initializers.items():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise WeightsError(ErrorCode.BAD_WEIGHTS, f"initializer {name!r} has NaN or Inf values")
        path = self.files.write(blob, "base.onnx")
        policy = self._session(path, None, 0)
        self._rebase(path, initializers)
        return policy

    def initial(self) -> LoadedPolicy:
        c = self.config
        loaded = load_weights_file(c.weights) if c.weights is not None else None
        if isinstance(loaded, bytes):
            policy = self._adopt_base(loaded)
        else:
            from networks.modules import export_onnx, load_numpy, make_actor

            actor = make_actor(self.spec, c.network, seed=c.init_seed)
            if loaded is not None:
                check_state_dict(
                    loaded,
                    {
                        k: (str(v.dtype).replace("torch.", ""), tuple(v.shape))
                        for k, v in actor.state_dict().items()
                    },
                )
                load_numpy(actor, loaded)
            policy = self._adopt_base(export_onnx(actor))
        policy.version = c.initial_version
        return policy

    def from_state_dict(
        self, arrays: dict[str, Any], version: int, *, finite_checked: bool = False
    ) -> LoadedPolicy:
        arrays = host_arrays(arrays)  # device tensors: onnxruntime's initializers are host memory
        check_state_dict(arrays, self.expected, check_finite=not finite_checked)
        return self._session(self.base, arrays, version)

    def from_onnx(self, blob: np.ndarray, version: int) -> LoadedPolicy:
        from onnx import numpy_helper

        model = parse_onnx(blob)
        for init in model.graph.initializer:
            arr = numpy_helper.to_array(init)
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise WeightsError(ErrorCode.BAD_WEIGHTS, f"initializer {init.name!r} has NaN or Inf values")
        # A name of its own: a refused model must not overwrite (then delete) the serving
        # graph, which a publication after a rollback reuses the version number of.
        path = self.files.write(blob, f"version-{version}-{os.urandom(4).hex()}.onnx")
        try:
            policy = self._session(path, None, version)
        except WeightsError:
            self.files.remove(path)
            raise
        self._rebase(path, {i.name: numpy_helper.to_array(i) for i in model.graph.initializer})
        return policy

    def describe(self) -> dict[str, Any]:
        on_gpu = self.providers[0] in GPU_PROVIDERS
        return {
            "backend": "onnxruntime",
            "device": f"cuda:{self.device_id}" if on_gpu else "cpu",
            "providers": list(self.providers),
            "onnxruntime": self.ort.__version__,
            "io_binding": on_gpu,
        }
