"""What every request passes on its way in and out: the middleware (request ids, logs, 500s),
back-pressure and metrics.
"""
