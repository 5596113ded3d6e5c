"""The only package that imports llama_cpp: models, contexts, sampling and the step loop."""
from engine.chat import ChatTemplate, ChatTemplateError
from engine.llama import Context, ContextConfig, Model
from engine.sampling import Sampler, SamplingParams
from engine.worker import EngineConfig, Event, Observer, QueueFull, Request, Worker

__all__ = ["ChatTemplate", "ChatTemplateError", "Context", "ContextConfig", "EngineConfig", "Event",
           "Model", "Observer", "QueueFull", "Request", "Sampler", "SamplingParams", "Worker"]
