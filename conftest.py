pytest_plugins = ["utils.checker.plugin"]  # the course's options, fixtures and mistake finder (utils/checker/)
