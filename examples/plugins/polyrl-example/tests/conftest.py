# polyrl's test kit: fixtures (polyrl_plugins, tiny_tokenizer...) and the conformance suites' assert rewriting.
pytest_plugins = ["polyrl.testing"]
