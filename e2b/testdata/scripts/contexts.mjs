// Drives the code interpreter's contexts through the unchanged SDK:
// createCodeContext (with and without cwd), runCode in a context and in the
// default one (each its own names, the same files), listCodeContexts,
// restartCodeContext, removeCodeContext. The Go test (e2b's
// TestCodeContextsSDK) checks what it prints: one JSON line per step.
import { Sandbox } from '@e2b/code-interpreter'

const out = (step, v) => console.log(JSON.stringify({ step, ...v }))
const sbx = await Sandbox.create(process.env.MOAT_TEMPLATE || 'code-interpreter-v1')

const ctx = await sbx.createCodeContext()
out('created', { language: ctx.language, cwd: ctx.cwd, id: typeof ctx.id === 'string' && ctx.id.length > 0 })
await sbx.runCode('x = "in the context"', { context: ctx })
await sbx.runCode('x = "in the default"')
out('names', { ctx: (await sbx.runCode('x', { context: ctx })).text, def: (await sbx.runCode('x')).text })

await sbx.files.write('/home/user/sub/f.txt', 'in sub')
const sub = await sbx.createCodeContext({ cwd: '/home/user/sub', language: 'python' })
out('cwd', {
  cwd: sub.cwd,
  read: (await sbx.runCode('open("f.txt").read()', { context: sub })).text,
  shared: (await sbx.runCode('open("sub/f.txt").read()', { context: ctx })).text,
  back: (await sbx.runCode('import os\nos.path.exists("sub")')).text,
})

const listed = await sbx.listCodeContexts()
out('listed', { same: listed.map((c) => c.id).sort().join() === [ctx.id, sub.id].sort().join(), n: listed.length })

await sbx.restartCodeContext(ctx)
const gone = await sbx.runCode('x', { context: ctx })
out('restarted', { error: gone.error?.name ?? null, def: (await sbx.runCode('x')).text })

await sbx.removeCodeContext(sub)
let removed
try {
  await sbx.runCode('1', { context: sub })
  removed = 'ran'
} catch (e) {
  removed = e.name
}
out('removed', { error: removed, n: (await sbx.listCodeContexts()).length })

let lang
try {
  await sbx.createCodeContext({ language: 'r' })
  lang = 'created'
} catch (e) {
  lang = e.name
}
out('language', { error: lang })
out('kill', { killed: await sbx.kill() })
// runCode leaves its request timer running when it throws on an error
// status (the removed context's 404): node would wait for it (60 s).
process.exit(0)
