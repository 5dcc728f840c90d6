// One streaming chat call with the official `openai` npm package against a live mlxd.
import OpenAI from "openai";

const base = process.argv[2];
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused" });
const stream = await client.chat.completions.create({
  model: "smollm2-135m",
  messages: [{ role: "user", content: "Say hello." }],
  max_tokens: 8,
  temperature: 0,
  stream: true,
  stream_options: { include_usage: true },
});
let text = "";
let finish = null;
let usage = null;
let chunks = 0;
for await (const chunk of stream) {
  chunks += 1;
  if (chunk.usage) usage = chunk.usage;
  for (const choice of chunk.choices) {
    text += choice.delta?.content ?? "";
    finish = choice.finish_reason ?? finish;
  }
}
const fail = (why) => {
  console.error(`FAIL node streaming chat: ${why}`);
  process.exit(1);
};
if (chunks < 2) fail(`only ${chunks} chunks`);
if (!text) fail("no text");
if (!["stop", "length"].includes(finish)) fail(`finish_reason ${finish}`);
if (!usage || usage.completion_tokens < 1) fail(`usage ${JSON.stringify(usage)}`);
console.log(`ok   node streaming chat (${chunks} chunks, ${usage.completion_tokens} tokens): ${JSON.stringify(text)}`);
