"""Built-in environments (installed as ``agentrl.envs``): one file each, one line to register."""

from agentrl.env import register

register("add-tool-v0", "agentrl.envs.add_tool:AddToolEnv")
register("arith-v0", "agentrl.envs.arith:ArithEnv")
register("guess-v0", "agentrl.envs.guess:GuessEnv")
register("math-v0", "agentrl.envs.math:MathEnv")
register("math-tool-v0", "agentrl.envs.math:MathToolEnv")
register("code-v0", "agentrl.envs.code:CodeEnv")
register("calc-chain-v0", "agentrl.envs.calc_chain:CalcChainEnv")
register("add-mcp-v0", "agentrl.envs.add_mcp:AddMCPEnv")
