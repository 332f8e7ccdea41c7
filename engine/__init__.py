"""Tandem's inference engine. The only public door is `engine.api`."""
