"""The GPU body of the learner: packed varlen layers, Triton attention and head kernels.

Owns :mod:`~agentrl.kernels.packed_body` (a decoder run over sequences packed into one row,
compiled layers; its varlen attention call in :mod:`~agentrl.kernels.varlen`),
:mod:`~agentrl.kernels.moe` (its Mixture-of-Experts layers: the model's router
module, grouped expert matmuls), :mod:`~agentrl.kernels.recompute` (the selective-recompute
policy), :mod:`~agentrl.kernels.attention` (varlen causal attention with GQA as a
``torch.library`` op, kernels in ``_attention_kernels``),
:mod:`~agentrl.kernels.head` (one-pass log-sum-exp and softmax-gradient kernels) and
:mod:`~agentrl.kernels.transfer` (host-to-device copies). See ``docs/architecture.md``.

Imports only torch, transformers and Triton; must never import any other ``agentrl``
package: kernels know tensors, not trajectories.
"""
