"""``SessionOptions`` and ``RunOptions`` as ONNX Runtime spells them.

The config entries hetproc acts on (others are kept and readable, as ORT keeps them)::

    session.disable_cpu_ep_fallback          "1": refuse, at creation, a model the listed
                                             accelerators cannot fully take
    session.record_ep_graph_assignment_info  "1": get_provider_graph_assignment_info()
    ep.context_enable                        "1": write an EP context model at creation
    ep.context_file_path                     where (default: beside the model, ``_ctx.onnx``)
    ep.context_embed_mode                    "1" (default): partitions inside the model;
                                             "0": beside it, one file per partition

``graph_optimization_level`` and ``log_severity_level`` are accepted and kept: hetproc
always folds constants (ORT's basic level) and logs through its trace, not a logger.
``enable_profiling`` writes the platform's trace (Chrome Trace JSON, Perfetto-valid) when
``end_profiling()`` is called, named ``{profile_file_prefix}_{date}.json``.
"""

from __future__ import annotations

import enum


class GraphOptimizationLevel(enum.IntEnum):
    """ORT's optimisation levels: accepted and kept; hetproc folds constants whatever
    the level (ORT's basic level), and partitions for its devices on top."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    """ORT's execution modes: accepted and kept; partitions on different devices run in
    parallel whenever their fences allow, whichever is set."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class SessionOptions:
    """ORT's session options: the attributes ORT has (kept; see the module docstring for
    what hetproc acts on), config entries, and providers for sessions that name none."""

    def __init__(self) -> None:
        self._config: dict[str, str] = {}
        self._providers: list[tuple[str, dict[str, str]]] = []
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.optimized_model_filepath = ""
        self.enable_cpu_mem_arena = True
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.use_deterministic_compute = False

    def add_provider(self, provider_name: str, provider_options: dict) -> None:
        """A provider for sessions (and ``ModelCompiler``) given no ``providers``, in the
        order added."""
        self._providers.append((str(provider_name),
                                {str(k): str(v) for k, v in dict(provider_options).items()}))

    def has_providers(self) -> bool:
        """Whether ``add_provider`` was called."""
        return bool(self._providers)

    def add_session_config_entry(self, key: str, value: str) -> None:
        """Set a config entry (strings only, as ORT's binding insists)."""
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError("add_session_config_entry(): key and value are strings")
        self._config[key] = value

    def get_session_config_entry(self, key: str) -> str:
        """A config entry; ORT's RuntimeError when it was never set."""
        if key not in self._config:
            raise RuntimeError(f"SessionOptions does not have configuration with key: {key}")
        return self._config[key]

    def config(self, key: str, default: str = "") -> str:
        """The entry, or ``default`` (hetproc's own reader; ORT's getter raises)."""
        return self._config.get(key, default)


class RunOptions:
    """``terminate`` set before (or during, from another thread) a run stops it with
    ``Fail``; ``logid`` is the run tag, carried into the trace as the run's marker."""

    def __init__(self) -> None:
        self.terminate = False
        self.logid = ""
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.only_execute_path_to_fetches = False
        self._config: dict[str, str] = {}

    def add_run_config_entry(self, key: str, value: str) -> None:
        """Set a run config entry (kept and readable; hetproc acts on none yet)."""
        self._config[str(key)] = str(value)

    def get_run_config_entry(self, key: str) -> str:
        """A run config entry; ORT's RuntimeError when it was never set."""
        if key not in self._config:
            raise RuntimeError(f"RunOptions does not have configuration with key: {key}")
        return self._config[key]
