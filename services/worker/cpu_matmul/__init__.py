"""How the linear layers multiply on the CPU: one strategy per module, each
x W^T for one layer's weight prepared once after the weights load
(strategy.py), and the choice among them for a model on this CPU (choose.py).

The measurements behind each choice are in bench/NOTES.md ("CPU matmul
strategies"), where `make bench`'s floor section re-measures them.
"""
from services.worker.cpu_matmul.choose import prepare_cpu_linears, weight_dtype_max_rows
from services.worker.cpu_matmul.strategy import matmul

__all__ = ["matmul", "prepare_cpu_linears", "weight_dtype_max_rows"]
