"""Jobs the elastic tests, the multi-host drivers and the chaos soak run on workers: the
step ledger (`ledger`: what each rank committed, checked for steps done twice or lost),
trained by `torch_ledger` (the torch face) or `keras_ledger` (the Keras face). Test
fixtures, not API: they live beside the clusters they are run on. The worker side, so they
import the faces (the one part of `raytrain_x.testing` that may)."""
