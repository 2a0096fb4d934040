"""tjit.autograd: reverse mode over the IR, fused backward kernels, and the tape that
holds what backward needs (see backward.py, vjp.py, views.py and tape.py)."""
