"""The agentic chat API on M3's own formats: tools and tool calls, reasoning, constrained (structured) output."""
