"""The quantizers: the Lloyd-Max codebook, the random Walsh-Hadamard rotation, bit packing, trellis codes, and the
paper's Algorithms 1 (TurboQuant_mse) and 2 (TurboQuant_prod) built on them."""
