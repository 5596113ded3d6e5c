// Ollama's official JavaScript client (the `ollama` package on npm, 0.6.x) against a running
// pagedllama server: list, show, ps, chat (streamed and not), generate, embed, tools in the
// request and a tool result sent back, format "json", and an unknown model's 404. Each check
// asserts what the client gets; the script exits 1 on the first failure and prints one line per
// check passed.
//
//   npm install --prefix .cache/ollama-js ollama@0.6.4        # once (.cache/ is git-ignored)
//   make run PORT=11434                                        # in another shell
//   OLLAMA_JS_MODULE=.cache/ollama-js/node_modules/ollama/dist/index.mjs \
//     node scripts/ollama_js_check.mjs
//
// OLLAMA_HOST: the server (default http://127.0.0.1:11434); OLLAMA_MODEL: the model (default:
// the first /api/tags lists); OLLAMA_JS_MODULE: where the client is (default: `ollama`, as
// node resolves it from this folder). tests/test_ollama_js.py runs it when node and the client
// are installed.
import assert from 'node:assert/strict'
import path from 'node:path'
import { pathToFileURL } from 'node:url'

const where = process.env.OLLAMA_JS_MODULE
const mod = await import(where ? pathToFileURL(path.resolve(where)).href : 'ollama')
const { Ollama } = mod
const host = process.env.OLLAMA_HOST || 'http://127.0.0.1:11434'
const client = new Ollama({ host })
const GREEDY = { temperature: 0, num_predict: 12 }
const COUNT = [{ role: 'user', content: 'Count from 1 to 10, separated by commas.' }]
const WEATHER = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  },
}

function ok(name, detail) {
  console.log(`ok   ${name}${detail ? ': ' + detail : ''}`)
}

async function collect(stream) {
  const parts = []
  for await (const part of stream) parts.push(part)
  return parts
}

const listed = await client.list()
assert.ok(listed.models.length > 0, 'list: no models')
for (const m of listed.models) {
  assert.match(m.name, /:/, 'list: a name without a tag')
  assert.equal(m.details.format, 'gguf')
  assert.ok(m.size > 0)
}
const model = process.env.OLLAMA_MODEL || listed.models[0].name
ok('list', listed.models.map((m) => m.name).join(', '))

const shown = await client.show({ model })
assert.equal(shown.details.format, 'gguf')
assert.ok(shown.capabilities.includes('completion'), 'show: no completion capability')
assert.ok(typeof shown.model_info === 'object' && shown.model_info !== null)
ok('show', `${shown.details.family} ${shown.details.parameter_size} ${shown.details.quantization_level}, capabilities ${shown.capabilities.join(' ')}`)

const whole = await client.chat({ model, messages: COUNT, options: GREEDY, stream: false })
assert.equal(whole.done, true)
assert.equal(whole.message.role, 'assistant')
assert.ok(whole.message.content.length > 0, 'chat: empty answer')
assert.equal(whole.done_reason, 'length')
assert.equal(whole.eval_count, 12)
assert.ok(whole.total_duration >= whole.eval_duration && whole.eval_duration > 0)
ok('chat', JSON.stringify(whole.message.content))

const chunks = await collect(await client.chat({ model, messages: COUNT, options: GREEDY, stream: true }))
assert.ok(chunks.length > 1, 'chat stream: a single object')
assert.deepEqual(chunks.map((c) => c.done), [...Array(chunks.length - 1).fill(false), true])
assert.equal(chunks.map((c) => c.message.content).join(''), whole.message.content)
assert.equal(chunks.at(-1).eval_count, 12)
ok('chat streamed', `${chunks.length} objects, the same text`)

const running = await client.ps()
const mine = running.models.find((m) => m.name === model || m.name === `${model}:latest`)
assert.ok(mine, `ps: ${model} not listed as loaded`)
assert.ok(mine.size > 0 && Date.parse(mine.expires_at) > Date.now())
ok('ps', `${mine.name} ${mine.size} bytes, expires ${mine.expires_at}`)

const prompt = 'Count from 1 to 10, separated by commas.'
const generated = await client.generate({ model, prompt, options: GREEDY, stream: false })
assert.equal(generated.done, true)
assert.equal(generated.response, whole.message.content, 'generate: not the chat answer')
const pieces = await collect(await client.generate({ model, prompt, options: GREEDY, stream: true }))
assert.equal(pieces.map((p) => p.response).join(''), generated.response)
ok('generate', `streamed (${pieces.length} objects) and not, the chat's answer`)

const embedded = await client.embed({ model, input: ['The sky is blue.', 'Grass is green.'] })
assert.equal(embedded.embeddings.length, 2)
for (const v of embedded.embeddings) {
  const norm = Math.sqrt(v.reduce((s, x) => s + x * x, 0))
  assert.ok(Math.abs(norm - 1) < 1e-3, `embed: norm ${norm}`)
}
assert.ok(embedded.prompt_eval_count > 0)
ok('embed', `2 vectors of ${embedded.embeddings[0].length}, L2-normalized`)

// a description no earlier request had: the prompt's tool section is computed, not taken
// from the prefix cache (prompt_eval_count counts the tokens computed)
const fresh = { ...WEATHER, function: { ...WEATHER.function, description: `The weather in a city (${Date.now()})` } }
const asked = [{ role: 'user', content: 'What is the weather in Paris?' }]
const plain = await client.chat({ model, messages: asked, options: GREEDY })
const withTools = await client.chat({ model, messages: asked, tools: [fresh], options: GREEDY })
assert.ok(withTools.prompt_eval_count > plain.prompt_eval_count + 20, 'tools: not in the prompt')
for (const call of withTools.message.tool_calls ?? []) {
  assert.equal(typeof call.function.arguments, 'object')
}
const history = [...asked,
  { role: 'assistant', content: '', tool_calls: [{ function: { name: 'get_weather', arguments: { city: 'Paris' } } }] },
  { role: 'tool', content: 'Sunny, 24 degrees', tool_name: 'get_weather' }]
const answered = await client.chat({ model, messages: history, tools: [WEATHER], options: GREEDY })
assert.ok(answered.message.content || answered.message.tool_calls)
ok('tools', `offered (prompt ${plain.prompt_eval_count} -> ${withTools.prompt_eval_count} tokens), ` +
   `a call and its result sent back: ${JSON.stringify(answered.message.content)}`)

const json = await client.chat({
  model, format: 'json', options: { temperature: 0, num_predict: 64 },
  messages: [{ role: 'user', content: 'Reply with a JSON object with the keys "name" and "age" of a cat.' }],
})
assert.equal(json.done_reason, 'stop', `format json: cut at ${json.eval_count} tokens`)
const parsed = JSON.parse(json.message.content)
assert.ok(typeof parsed === 'object' && parsed !== null && !Array.isArray(parsed))
const CAT = {
  type: 'object', additionalProperties: false, required: ['name', 'age'],
  properties: { name: { type: 'string', maxLength: 16 }, age: { type: 'integer' } },
}
const held = await client.chat({
  model, format: CAT, options: { temperature: 0, num_predict: 64 },
  messages: [{ role: 'user', content: 'Describe a cat as JSON.' }],
})
const cat = JSON.parse(held.message.content)
assert.deepEqual(Object.keys(cat).sort(), ['age', 'name'])
assert.ok(Number.isInteger(cat.age) && typeof cat.name === 'string' && cat.name.length <= 16)
ok('format json', `${json.message.content}; with a schema: ${held.message.content}`)

await assert.rejects(client.chat({ model: 'no-such-model', messages: COUNT }), (err) => {
  assert.equal(err.name, 'ResponseError')
  assert.equal(err.status_code, 404)
  assert.match(err.error, /not found/)
  return true
})
ok('unknown model', '404 ResponseError')
console.log(`all checks passed (ollama-js against ${host}, model ${model})`)
