"""Reward checkers (installed as ``agentrl.verifiers``): math answers, code run in a sandbox."""
