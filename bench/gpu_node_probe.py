"""Device experiment: eval cost per graph node, fused vs built-in RMSNorm,
chained and independent; for ncu kernel timings run a few calls only."""
import statistics, sys, time
import mlx.core as mx
from mlx_dualnorm import CompiledDualHeadNorm, composed_dual_head_norm

eps = 1e-6
fused = CompiledDualHeadNorm(eps, "fused")
paths = {"composed": lambda q, k: composed_dual_head_norm(q, k, None, None, eps), "fused": lambda q, k: fused(q, k)}
q0 = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
mx.eval(q0)
if len(sys.argv) > 1 and sys.argv[1] == "ncu":
    for name, path in paths.items():
        for _ in range(5):
            mx.eval(path(q0, q0))
    sys.exit(0)

def measure(path, chained, layers=48, tokens=300):
    builds, evals = [], []
    for t in range(tokens + 30):
        start = time.perf_counter()
        outs = []
        q, k = q0, q0
        for _ in range(layers):
            if chained:
                q, k = path(q, k)
            else:
                outs.extend(path(q0, q0))
        built = time.perf_counter()
        mx.eval((q, k) if chained else outs)
        done = time.perf_counter()
        if t >= 30:
            builds.append((built - start) * 1e6); evals.append((done - built) * 1e6)
    return statistics.median(builds), statistics.median(evals)

for repeat in range(3):
    for chained in (True, False):
        for name, path in paths.items():
            b, e = measure(path, chained)
            print(f"{name:9s} chained={chained!s:5s} build {b:7.1f} eval {e:7.1f} total {b+e:7.1f}")
