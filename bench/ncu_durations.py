"""Reads ncu's text report (stdin) of a --metrics gpu__time_duration.sum run
and prints each kernel's launches: median [min-max] µs, by kernel name,
then the sum of every launch's time."""
import re
import statistics
import sys

durations = {}
kernel = None
for line in sys.stdin:
    header = re.match(r"\s{2}(\S.*?)\s+\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
    if header:
        kernel = header.group(1)
        kernel = re.sub(r"^void\s+", "", kernel)
        kernel = re.sub(r"\(.*$", "", kernel)[:90]
        continue
    metric = re.search(r"gpu__time_duration\.sum\s+(\S+)\s+([\d.,]+)", line)
    if metric and kernel:
        value = float(metric.group(2).replace(",", ""))
        value = value / 1000 if metric.group(1) == "ns" else value
        durations.setdefault(kernel, []).append(value)
for name, values in sorted(durations.items()):
    print(f"{statistics.median(values):6.2f} [{min(values):.2f}-{max(values):.2f}] µs  "
          f"x{len(values):<3d} {name}")
print(f"{sum(sum(values) for values in durations.values()):8.2f} µs in "
      f"{sum(len(values) for values in durations.values())} launches, all kernels")
