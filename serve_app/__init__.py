"""The Ray Serve app: an OpenAI-compatible ingress in front of one engine replica per GPU. No model logic here."""
