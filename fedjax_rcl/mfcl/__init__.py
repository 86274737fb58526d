"""MFCL (Motamedi & Kim, TMLR): modular federated contrastive learning with Twin Normalization.

Phase 1's client algorithm is ``fedjax_rcl.algorithms.mfcl``; the clients' frozen encoders and
the representations they send are ``encoder``; phase 2 (the server's contrastive training on
those representations) is ``phase2``; the linear probe ``probe``; the analytic client resource
counts ``resources``; the ``fedjax-rcl mfcl`` command (both phases, the probe, the resource
figures, resume) ``run``.
"""
