"""Local-steps front-end of the compression core: DiLoCo-style training whose outer steps
(pseudo-gradients ``theta_global - theta_local``) go through gradwire's sparsifiers, codecs and
exchanges, with rounds that may stay open across inner steps (see docs/architecture.md).
"""
