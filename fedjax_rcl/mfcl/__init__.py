"""MFCL (Motamedi & Kim, TMLR): modular federated contrastive learning with Twin Normalization.

Phase 1's client algorithm is ``fedjax_rcl.algorithms.mfcl``; phase 2 (the server's contrastive
training on the clients' representations) is ``phase2``; the linear probe ``probe``; the
``fedjax-rcl mfcl`` command (both phases, the probe, the resource figures, resume) ``run``.
"""
