"""autopar: a compiler for distributed training.

``autopar.plan(model, mesh, example_inputs)`` decides how to split every op of a single-device model over a
device mesh; ``autopar.parallelize(...)`` also rewrites it into this rank's program and returns a ParallelModule.
"""

from autopar.api import parallelize, plan
from autopar.compare import Comparison, compare
from autopar.handwritten import handwritten
from autopar.errors import AutoparError, InfeasibleError, MeshError, NotRealised, PlanMismatchError, ShardingError, TraceError
from autopar.hardware import PRESETS, Hardware, Link
from autopar.mesh import Mesh
from autopar.pipeline import PipelinePin
from autopar.cluster import Cluster
from autopar.plan import Plan
from autopar.precision import MixedPrecision
from autopar.runtime import ParallelModule
from autopar.solver import Pin, ZeroPin
from autopar.spec import Partial, Replicate, Shard, Spec, Strategy

__all__ = [
    "parallelize", "plan", "compare", "Comparison", "handwritten", "Mesh", "Plan", "ParallelModule", "Pin", "ZeroPin", "PipelinePin", "Cluster", "Spec", "Strategy", "Shard", "Replicate",
    "Partial", "Hardware", "Link", "PRESETS", "MixedPrecision", "AutoparError", "TraceError", "MeshError", "ShardingError",
    "InfeasibleError", "PlanMismatchError", "NotRealised",
]
