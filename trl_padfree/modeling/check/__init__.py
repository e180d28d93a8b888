"""What decides, before training, whether a model packs: the architecture check on a tiny twin (packability.py, with
`verify_packable` its one entry point; twin.py, family_twins.py), which kernel each attention layer would run
(kernel_coverage.py), and the stand-in context that runs the CUDA branches on CPU for the check and the tests
(stand_ins.py). What runs in a step is the rest of modeling/."""
