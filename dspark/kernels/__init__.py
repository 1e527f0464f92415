"""dspark's C++ CPU kernels: the sources in csrc/ (one registration file, register.cpp; the others
named by the instruction set they need), their build (build.py), their fake implementations for
torch.compile (fake.py) and the Python entry points (cpu.py). Nothing here imports the model
layers: they import it."""
