"""The HTTP routes, one APIRouter per module; `llmopt.serve.app.build_app` mounts them."""
