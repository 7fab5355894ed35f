"""Tools over traces: replay (re-derive every plan from a recorded trace), simulate (what-if with a fitted cost
model), workload (arrivals, synthetic or recorded), timeline (Perfetto JSON and a PNG Gantt chart).

They run the real scheduler core with no model, so nothing here imports MLX.
"""
