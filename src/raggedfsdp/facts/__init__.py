"""Facts that the runtime, the cost model, the models and the job share, each stated once.

- :mod:`.degrees`: the parallel degrees of a run, one noun (:class:`ParallelDims`, in the spirit
  of torchtitan's);
- :mod:`.tp_plan`: which parameter of a GPT / Llama-style decoder tensor parallelism splits how
  (torchtitan's plans), from which ``models/tensor_parallel.py`` builds its
  ``parallelize_module`` plans and ``capacity/parallel.py`` computes each rank's shapes;
- :mod:`.cuts`: where a tensor- or expert-parallel split may cut a parameter without cutting a
  block of the shard policy, called by ``fully_shard`` and by the capacity planner alike;
- :mod:`.systems`: what raggedfsdp and FSDP2 do with a unit's bytes (where each copy runs, what
  is staged, how many collectives), which the cost model costs and
  ``tests/distributed/test_facts_conformance.py`` holds against what the runtime records.

Pure Python over shapes: no process group, no allocation. It sits on ``layout`` (the shard
policy) and under everything that shares these facts.
"""

from .cuts import check_cut, chunk_cuts, first_cut_inside_block
from .degrees import ParallelDims
from .systems import (
    FSDP2,
    RAGGEDFSDP,
    SYSTEMS,
    GlooReduceScatter,
    HostCopies,
    Staging,
    Stream,
    System,
    as_system,
)
from .tp_plan import FUSED_EXPERTS, PER_HEAD, TOKEN_EMBEDDING, TP_PLAN, TPStyle, tp_dim, tp_style

__all__ = [
    "FSDP2",
    "FUSED_EXPERTS",
    "PER_HEAD",
    "RAGGEDFSDP",
    "SYSTEMS",
    "TOKEN_EMBEDDING",
    "TP_PLAN",
    "GlooReduceScatter",
    "HostCopies",
    "ParallelDims",
    "Staging",
    "Stream",
    "System",
    "TPStyle",
    "as_system",
    "check_cut",
    "chunk_cuts",
    "first_cut_inside_block",
    "tp_dim",
    "tp_style",
]
