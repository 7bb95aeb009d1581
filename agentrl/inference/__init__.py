"""Inference backends behind one protocol: SGLang over HTTP, or the embedded engine."""

from agentrl.inference.base import GenerateOutput, InferenceClient, SamplingParams

__all__ = ["GenerateOutput", "InferenceClient", "SamplingParams"]
