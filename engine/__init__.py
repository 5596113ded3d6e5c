"""The only package that imports llama_cpp: models, contexts, sampling and the step loop."""
from engine.chat import ChatTemplate, ChatTemplateError
from engine.llama import Context, ContextConfig, Model
from engine.sampling import Sampler, SamplingParams
from engine.request import Event, Request
from engine.stats import ContextStats
from engine.worker import EngineConfig, Observer, QueueFull, Worker

__all__ = ["ChatTemplate", "ChatTemplateError", "Context", "ContextConfig", "ContextStats",
           "EngineConfig", "Event", "Model", "Observer", "QueueFull", "Request", "Sampler",
           "SamplingParams", "Worker"]
