// One non-stream and one stream call through memproxy with the official openai Node SDK.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "sk-node-client", maxRetries: 0 });
const plain = await client.chat.completions.create({
  model: "fake-echo",
  messages: [{ role: "user", content: "from node" }],
});
const stream = await client.chat.completions.create({
  model: "fake-echo",
  stream: true,
  messages: [{ role: "user", content: "node streams too" }],
});
let streamed = "";
for await (const chunk of stream) streamed += chunk.choices[0]?.delta?.content ?? "";
console.log(JSON.stringify({ plain: plain.choices[0].message.content, streamed }));
